"""The kernels at a decode step's two ends, each one launch instead of several torch ops (CUDA).

    resolve_tokens   token ids with the placeholders -(i + 1) replaced by future slot i's token (the previous
                     step's sample): torch's where / neg / clamp / index are six launches
    embed_tokens     the same resolve and the embedding rows of a 16-bit table in one launch, which lets the first
                     layer's kernel launch right after its wait (programmatic dependent launch: the first GEMV
                     requests its weights while the rows are gathered); a step graph's lookup
    greedy_argmax    the argmax of each logits row (first index among equal maxima, as torch.argmax): every
                     program takes a chunk of a row and parks its best, and the row's last program to finish
                     (a ticket) picks the best chunk; torch's chunked max and argmax are five launches. In a
                     step graph it also stores each token into the runner's future slot, where the runner
                     copied it after the replay (one launch fewer)

W2 int4 on the H200 spent ~23 us of a 1.79 ms step before its first GEMV and ~28 after lm_head, in thirteen small
kernels (fourteenth session, results/s14/call6_tl_int4_final.jsonl). NaN logits are not ordered as torch orders
them (torch's argmax picks a NaN; here it depends on the chunk, and the id is kept inside the vocabulary).
Measured (fifteenth session, H200): W2 int4 552.1 -> 555.9 and 551.3 -> 554.9 tok/s, bf16 235.0 -> 236.4; the
first GEMV now starts 11.8 us into the step (23.4 before) and the step ends 9 us sooner after lm_head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import _reset_ticket, split_counters
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

ARGMAX_BLOCK = 4096  # logits a program reduces: 32 programs a row for a 128k vocabulary
ARGMAX_MAX_CHUNKS = 64  # what the last program merges in one tile (vocabularies up to 256k)


@triton.jit
def _resolved(ids, future_ptr, mask):
    """ids with each placeholder -(i + 1) replaced by future slot i's token (the previous step's sample)."""
    placeholder = ids < 0
    future = tl.load(future_ptr + tl.where(placeholder, -ids - 1, 0), mask=mask & placeholder, other=0)
    return tl.where(placeholder, future, ids)


@triton.jit(do_not_specialize=["n"])  # the step's token count: no variant per value class
def _resolve_kernel(ids_ptr, future_ptr, out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = _resolved(tl.load(ids_ptr + offs, mask=mask, other=0), future_ptr, mask)
    tl.store(out_ptr + offs, ids.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embed_kernel(ids_ptr, future_ptr, table_ptr, out_ptr, hidden, stride_table, stride_out,
                  RESOLVE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # right after the wait the next kernel (the first layer's) may launch: it requests its weights while the
    # rows are gathered
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    token = tl.load(ids_ptr + t)
    if RESOLVE:
        token = _resolved(token, future_ptr, True)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    row = tl.load(table_ptr + token.to(tl.int64) * stride_table + cols, mask=mask)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, row.to(out_ptr.dtype.element_ty), mask=mask)


def embed_tokens(token_ids: torch.Tensor, table: torch.Tensor, dtype: torch.dtype,
                 future_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `table` [vocab, hidden] (unit last stride) for token_ids [T], as `dtype`, in one launch; with
    `future_tokens`, each placeholder -(i + 1) is first replaced by future_tokens[i] (resolve_tokens)."""
    if table.stride(1) != 1:
        raise ValueError(f"embed_tokens takes a table with unit last stride, got strides {table.stride()}")
    count, hidden = token_ids.numel(), table.shape[1]
    out = torch.empty((count, hidden), dtype=dtype, device=table.device)
    if count:
        block = min(1024, triton.next_power_of_2(hidden))
        future = token_ids if future_tokens is None else future_tokens
        _embed_kernel[(count, triton.cdiv(hidden, block))](token_ids, future, table, out, hidden, table.stride(0),
                                                           out.stride(0), RESOLVE=future_tokens is not None,
                                                           BLOCK=block, **pdl_args())
    return out


RESOLVE_BLOCK = 1024


def resolve_tokens(token_ids: torch.Tensor, future_tokens: torch.Tensor) -> torch.Tensor:
    """token_ids [T] with each -(i + 1) replaced by future_tokens[i], in future_tokens' dtype."""
    out = torch.empty(token_ids.shape, dtype=future_tokens.dtype, device=token_ids.device)
    n = token_ids.numel()
    if n:
        # one block size (a power of two of n was a compile per size class: W7's eager steps stalled on them)
        _resolve_kernel[(triton.cdiv(n, RESOLVE_BLOCK),)](token_ids, future_tokens, out, n, BLOCK=RESOLVE_BLOCK,
                                                          **pdl_args())
    return out


@triton.jit
def _argmax_kernel(x_ptr, stride_x, vocab, best_v_ptr, best_i_ptr, cnt_ptr, out_ptr, future_ptr, base_ptr,
                   future_rows, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   FUTURE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    value, index = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_v_ptr + row * CHUNKS + chunk, value)
    tl.store(best_i_ptr + row * CHUNKS + chunk, chunk * BLOCK + index)
    tl.debug_barrier()  # the chunk's best is written before the ticket (release) is taken
    if tl.atomic_add(cnt_ptr + row, 1) == CHUNKS - 1:  # the row's last chunk picks the best one
        c = tl.arange(0, CHUNKS_PAD)
        values = tl.load(best_v_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(best_i_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=0, cache_modifier=".cg")
        winner = tl.argmax(values, 0, tie_break_left=True)  # the first chunk among equal maxima
        # NaN logits order no way in particular, and a masked tail's index may win: never an id past the vocabulary
        # (an embedding gather of one asserts on the device, which ends the process)
        token = tl.minimum(tl.maximum(tl.sum(tl.where(c == winner, indices, 0)), 0), vocab - 1).to(tl.int64)
        tl.store(out_ptr + row, token)
        if FUTURE:  # the runner's future slot base + row too, within that half of the slots
            tl.store(future_ptr + tl.load(base_ptr) + row, token, mask=row < future_rows)
        _reset_ticket(cnt_ptr + row)


def greedy_argmax(logits: torch.Tensor, future: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """logits [R, V] (unit last stride; R at most 64, V at most ARGMAX_MAX_CHUNKS * ARGMAX_BLOCK) -> int64 [R].
    future = (slots, base): each row r's token is also stored into slots[base + r] for r < len(slots) / 2
    (base: a one-element int64 tensor, 0 or len(slots) / 2; the runner's future-token halves)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, ARGMAX_BLOCK)
    if logits.stride(1) != 1 or chunks > ARGMAX_MAX_CHUNKS or rows > 64:
        raise ValueError(f"greedy_argmax takes at most 64 rows of at most {ARGMAX_MAX_CHUNKS * ARGMAX_BLOCK} "
                         f"contiguous logits, got {tuple(logits.shape)} with strides {logits.stride()}")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    best_values = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    best_indices = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    slots, base = future if future is not None else (out, out)
    _argmax_kernel[(chunks, rows)](logits, logits.stride(0), vocab, best_values, best_indices,
                                   split_counters(logits.device, rows), out, slots, base, slots.numel() // 2,
                                   CHUNKS=chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), BLOCK=ARGMAX_BLOCK,
                                   FUTURE=future is not None, **pdl_args())
    return out
