"""TritonAttention: split-K paged decode attention and varlen paged prefill attention (the KV write is in
kv_write.py, the int8-KV decode loops in int8_decode.py).

Cache (one layer, KVCache): views [num_pages, tokens_per_page, kv_heads, head_dim] with any strides (the
layout is head-major by default, engine/kv/layout.py), any tokens_per_page. Token t of a request in slot s
lives in page page_table[s, t // tokens_per_page] at offset t % tokens_per_page. Quantized caches (int8,
int4 packed two a byte, fp8 e4m3) carry an fp16 scale per token and head: the write kernels quantize
(absmax / qmax, round half up), and `_load_kv_tile` hands the stored values and the scales to the
attention loops, which fold the K scale into the scores and the V scale into the probabilities, since a
per-token scale commutes with both dot products: no per-element dequantize multiply. int8 decode of 16-bit
models runs its own loops (int8_decode.py); int8 prefill of 16-bit models dequantizes each tile to fp16 in
registers (int8_decode._int8_tile: byte tricks, no int -> float conversions) for fp16 dots.
Decode splits each sequence into NUM_SPLITS equal pieces (so one graph serves every length), each
program handling all query heads of one KV head; the last program of a row and KV head to finish (a ticket
from a self-resetting counter) merges the pieces by their log-sum-exp, so decode is one launch (with one
split, the W1 case, the program writes the output itself). The grid's fastest axis is the KV head, so
programs start in batch-row order: the runner orders decode rows longest first, which keeps the longest
sequences off the tail of a batch of mixed lengths.
Prefill programs each take BLOCK_M queries of one head of one request's chunk.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache, kv_kind
from dflash2.kernels.triton.gemv_parts import INLINE_ASM, _reset_ticket, multiprocessors, split_counters
from dflash2.kernels.triton.int8_decode import (_int8_decode_tiles, _int8_imma_t_tiles, _int8_tile,
                                                int8_path, int8_sub_tiles)
from dflash2.kernels.triton.kv_write import _rotated_rows, rotary_write_kv, scale_args, write_kv
from dflash2.kernels.triton.pdl import pdl_args, pdl_release, pdl_start, pdl_wait

PREFILL_BLOCK_M = 64
DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}  # best of benchmarks/tune_decode.py on H200

# per KV kind ("int8-<loop>" for int8) where tuning found better; else DECODE_CONFIG. int8 imma_t: picked on W1
# itself, because the kernel tune (benchmarks/tune_decode.py, layer 0 alone, even with W1's own prompts in
# engine-like pages) has ranked its configs unlike W1 three sessions running: on the H200, W1's int8 decode phase
# took 2.541 s at 32/1/2 against 2.860 s at 64/2/2 (the previous default), 2.913 at 32/2/2 (the tune's pick),
# 3.07-3.87 at 64/1/2, 64/4/2, 128/2/2 and 128/4/2 (eighth session, calls 1-2). legacy: third session
DECODE_CONFIGS: dict[str, dict[str, int]] = {"int8-imma_t": {"BLOCK_N": 32, "num_warps": 1, "num_stages": 2},
                                             "int8-legacy": {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}}


# A 16-bit cache under 4+ query heads a KV head (Llama-3-8B: 32 / 8): benchmarks/kv_spread.py on one H100, layer
# 0 of Llama-3-8B over 300 requests of 500 tokens, 2.759 TB/s (222.8 us) against DECODE_CONFIG's 2.587 (237.5);
# 32 x 1,200 tokens 72.4 against 73.1 us (issue 44, W7's decode). DECODE_CONFIG stays for GQA 2 (tuned on W1).
DECODE_CONFIG_WIDE_GROUP = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def default_decode_config(q: torch.Tensor, k_cache: torch.Tensor) -> dict:
    """decode_attention's config for this q and cache: DECODE_CONFIGS by KV kind (int8: by its loop); a 16-bit
    cache with 4 or more query heads a KV head: DECODE_CONFIG_WIDE_GROUP."""
    kind = kv_kind(k_cache.dtype)
    if kind == "int8":
        kind = f"int8-{int8_path(q, {})}"
    if kind in DECODE_CONFIGS:
        return DECODE_CONFIGS[kind]
    if k_cache.element_size() == 2 and q.shape[1] >= 4 * k_cache.shape[2]:
        return DECODE_CONFIG_WIDE_GROUP
    return DECODE_CONFIG


# A single stream's decode over a short context (a step graph of its own: engine/graphs.py's `short` shape):
# SHORT_SPLITS splits of one SHORT_CONFIG tile each up to SHORT_MAX_TOKENS tokens, against 16 splits of 32-token
# tiles otherwise. Fewer programs: they are all resident while the qkv GEMV before them still runs, and the
# merge reads 4 partials, not 16. W2 int4 on the H200 (twenty-third session): 585.6 / 585.8 tok/s at 4 splits
# of 128 tokens on 4 warps against 582.4 / 581.3 at the default (calls 1-2; bf16 238.8 / 238.7); 16 splits
# of 128-token tiles, those past the length gone before their wait: 577.5 / 577.5 against 584.7 / 584.2 (call
# 4); 2 splits of 256: 569.2 (8 warps), 529.0 (4); 4 of 128 on 8 warps 574.7, on 2 warps 532.7, with 2 stages
# 552.9; 8 of 64: 568.8 (4 warps), 540.5 (2); one split of 512: 505.0. Only for a 16-bit cache (int8 has its
# own loops).
# KV_PREFETCH: each program asks L2 for its first KV tile's lines before its PDL wait (the page-table entries are
# read there already, PAGES_EARLY), so its KV loads after the wait hit L2 instead of HBM. At one row the KV loop
# is the largest part of attention (W2 int4 on the H200, twenty-fifth session, call 2: 625.0 tok/s with the loop
# left out against 591.5; the merge left out 600.7), and the programs start ~2.6 us before the qkv GEMV ends. W2
# int4 597.1 / 596.7 with the prefetch against 591.5 / 591.2, bf16 238.0 against 237.5 (same call).
SHORT_SPLITS = 4
SHORT_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1, "KV_PREFETCH": 1}
SHORT_MAX_TOKENS = SHORT_SPLITS * SHORT_CONFIG["BLOCK_N"]


@triton.jit
def _load_kv_tile(k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                  stride_cache_page, stride_cache_token, stride_cache_head,
                  stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page,
                  HEAD_DIM: tl.constexpr, KIND: tl.constexpr):
    """K and V [len(tokens), HEAD_DIM] of one KV head, gathered through the request's page-table row, with
    their row scales [len(tokens)] (ones for a float cache). Quantized tiles hold the stored integers / fp8
    values: the scales are applied by the caller to the scores and probabilities (they are per token, so
    they factor out of both dot products)."""
    return _load_kv_tile_at(_tile_pages(page_table, slot, tokens, token_mask, stride_pt, tokens_per_page),
                            k_cache, v_cache, k_scales, v_scales, tokens, token_mask, kv_head,
                            stride_cache_page, stride_cache_token, stride_cache_head,
                            stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, HEAD_DIM, KIND)


@triton.jit
def _tile_pages(page_table, slot, tokens, token_mask, stride_pt, tokens_per_page):
    """The page of each of `tokens` (0 where masked), from the request's page-table row."""
    return tl.load(page_table + slot * stride_pt + tokens // tokens_per_page, mask=token_mask, other=0).to(tl.int64)


@triton.jit
def _load_kv_tile_at(page, k_cache, v_cache, k_scales, v_scales, tokens, token_mask, kv_head,
                     stride_cache_page, stride_cache_token, stride_cache_head,
                     stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page,
                     HEAD_DIM: tl.constexpr, KIND: tl.constexpr):
    """_load_kv_tile with the tokens' pages already looked up (_tile_pages)."""
    in_page = tokens % tokens_per_page
    offs = page * stride_cache_page + in_page * stride_cache_token + kv_head * stride_cache_head
    if KIND == 2:
        j = tl.arange(0, HEAD_DIM // 2)
        kb = tl.load(k_cache + offs[:, None] + j[None, :], mask=token_mask[:, None], other=0).to(tl.int32)
        vb = tl.load(v_cache + offs[:, None] + j[None, :], mask=token_mask[:, None], other=0).to(tl.int32)
        k = tl.interleave((kb & 15) - 8, (kb >> 4) - 8)
        v = tl.interleave((vb & 15) - 8, (vb >> 4) - 8)
    else:
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
    if KIND == 0:
        k_scale = tl.full(tokens.shape, 1.0, tl.float32)
        v_scale = k_scale
    else:
        scale_offs = page * stride_scale_page + in_page * stride_scale_token + kv_head * stride_scale_head
        k_scale = tl.load(k_scales + scale_offs, mask=token_mask, other=0.0).to(tl.float32)
        v_scale = tl.load(v_scales + scale_offs, mask=token_mask, other=0.0).to(tl.float32)
    return k, v, k_scale, v_scale


@triton.jit
def _tile_scores(q, k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                 stride_cache_page, stride_cache_token, stride_cache_head,
                 stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, scale,
                 HEAD_DIM: tl.constexpr, KIND: tl.constexpr, PRECISION: tl.constexpr):
    """One KV tile for the online softmax: the scores q K^T * scale (K scales folded in), with the tile's
    V and V scales."""
    k, v, k_scale, v_scale = _load_kv_tile(
        k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
        stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
        stride_scale_head, tokens_per_page, HEAD_DIM, KIND)
    return _scores(q, k, k_scale, scale, KIND, PRECISION), v, v_scale


@triton.jit
def _scores(q, k, k_scale, scale, KIND: tl.constexpr, PRECISION: tl.constexpr):
    """q K^T * scale for a loaded tile, its K scales folded in."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if KIND != 0:
        s = s * k_scale[None, :]
    return s * scale


@triton.jit
def _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND: tl.constexpr, PRECISION: tl.constexpr,
                    ROWS_MAY_BE_EMPTY: tl.constexpr):
    """One KV tile into the online softmax: masked scores s [R, N] (-inf where not attended), the tile's V
    [N, D] and V scales; returns the new (running max, denominator, accumulator). ROWS_MAY_BE_EMPTY: a row
    may have no attended token yet (causal prefill), so its max stays -inf and must not be subtracted."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROWS_MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KIND != 0:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, page_table, slots, lengths, out_ptr, lse_ptr,
                         final_ptr, cnt_ptr, k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, q_norm_w, k_norm_w, norm_eps,
                         stride_qt, stride_qh, stride_cache_page, stride_cache_token, stride_cache_head,
                         stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                         stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
                         scale, tokens_per_page,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr,
                         PRECISION: tl.constexpr, KIND: tl.constexpr, INT8_LOOP: tl.constexpr,
                         INT8_SUB: tl.constexpr, USE_PDL: tl.constexpr, ROTARY: tl.constexpr = False,
                         KV_PREFETCH_LINES: tl.constexpr = 0, QK_NORM: tl.constexpr = False):
    """The next kernel may launch only once the partial is stored, not right after the wait, so that its early
    weight loads stay off this kernel's latency-bound loads (measured: the note below DECODE_WAVES).
    ROTARY (a float cache; decode_attention's `rotary`): q and the step's k and v come un-rotated and unwritten
    (the qkv output); each program rotates its q heads, and the split holding the step's position (length - 1)
    rotates k, writes k and v into the cache and adds that one token to its softmax from registers, so its KV
    loop, like every other split's, reads only positions earlier steps wrote. QK_NORM (with ROTARY; Qwen3): q and
    k are RMS-normed per head first (weights q_norm_w, k_norm_w), as the rotary KV write's qk_norm does.
    PAGES_EARLY (not int8, rows split): the first KV tile's page-table entries are read before the wait (the host
    writes the page table before the step's first kernel), each next tile's with the tile before.
    KV_PREFETCH_LINES (with PAGES_EARLY, a float cache): the first tile's K and V rows, KV_PREFETCH_LINES 128-byte
    lines each, asked of L2 before the wait; 0: not."""
    # the KV head is the fastest grid axis: programs start in row order, all heads of a row together, so a
    # batch ordered longest-first (the runner's order) starts its longest programs first
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    # lengths and slots come from the host before the step's first kernel: read before the wait (pdl.py)
    length = tl.load(lengths + b)
    slot = tl.load(slots + b).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    used = tl.maximum(tl.cdiv(length, tl.maximum(per_split, 1)), 1)  # an empty row: split 0 writes its zeros
    if split >= used:  # past the length: nothing to store and no ticket; gone before the wait (its slot freed)
        return
    end = tl.minimum(start + per_split, length)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.maximum(length - 1, 0)  # the step's token
    holds_new = (start <= pos) & (pos < end)  # this split adds it (ROTARY)
    loop_end = tl.minimum(end, pos) if ROTARY else end
    if ROTARY:  # the rotary tables and the new token's page: constant or host-written, read before the wait
        cos = tl.load(cos_ptr + pos * stride_cos + d % HALF)
        sin = tl.load(sin_ptr + pos * stride_cos + d % HALF)
        new_page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
        new_offs = (new_page * stride_cache_page + (pos % tokens_per_page) * stride_cache_token
                    + kv_head * stride_cache_head + d)
        if QK_NORM:  # constants: the weights at each column and at its rotary partner's
            q_w, q_w_swapped = tl.load(q_norm_w + d), tl.load(q_norm_w + (d + HALF) % HEAD_DIM)
            k_w, k_w_swapped = tl.load(k_norm_w + d), tl.load(k_norm_w + (d + HALF) % HEAD_DIM)
    PAGES_EARLY: tl.constexpr = KIND != 1 and NUM_SPLITS > 1  # one split (W1: long loops) lost 10% with it
    if PAGES_EARLY:
        first_tokens = start + tl.arange(0, BLOCK_N)
        pages = _tile_pages(page_table, slot, first_tokens, first_tokens < loop_end, stride_pt, tokens_per_page)
        if KV_PREFETCH_LINES > 0:
            _kv_tile_to_l2(pages, k_cache, v_cache, first_tokens, first_tokens < loop_end, kv_head, stride_cache_page,
                           stride_cache_token, stride_cache_head, tokens_per_page, HEAD_DIM, KV_PREFETCH_LINES)
    pdl_wait(USE_PDL)

    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q_offs = b * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + d[None, :], mask=head_mask[:, None], other=0.0)
    if ROTARY:
        first_half = d < HALF
        q_swapped = tl.load(q_ptr + q_offs + ((d + HALF) % HEAD_DIM)[None, :], mask=head_mask[:, None], other=0.0)
        if QK_NORM:
            q, q_swapped = _head_normed(q, q_swapped, q_w[None, :], q_w_swapped[None, :], norm_eps, HEAD_DIM)
        q = _rotated_rows(q, q_swapped, cos[None, :], sin[None, :], first_half[None, :])
        new_mask = holds_new & (d < HEAD_DIM)  # the split's flag over the row
        k_offs = b * stride_knt + kv_head * stride_knh
        k_new = tl.load(k_new_ptr + k_offs + d, mask=new_mask, other=0.0)
        k_new_swapped = tl.load(k_new_ptr + k_offs + (d + HALF) % HEAD_DIM, mask=new_mask, other=0.0)
        if QK_NORM:
            k_new, k_new_swapped = _head_normed(k_new[None, :], k_new_swapped[None, :], k_w[None, :],
                                                k_w_swapped[None, :], norm_eps, HEAD_DIM)
            k_new, k_new_swapped = tl.reshape(k_new, [HEAD_DIM]), tl.reshape(k_new_swapped, [HEAD_DIM])
        v_new = tl.load(v_new_ptr + b * stride_vnt + kv_head * stride_vnh + d, mask=new_mask, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if KIND == 1 and INT8_LOOP == "imma_t":  # its own state: per-warp softmax, merged before returning
        m_i, l_i, acc = _int8_imma_t_tiles(
            q, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head, stride_pt,
            stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
            stride_scale_head, tokens_per_page, scale, GROUP_PAD, HEAD_DIM, BLOCK_N, INT8_SUB)
    elif KIND == 1:
        m_i, l_i, acc = _int8_decode_tiles(
            q, m_i, acc, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head, stride_pt,
            stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
            stride_scale_head, tokens_per_page, scale, GROUP_PAD, HEAD_DIM, BLOCK_N, PRECISION)
    else:
        for n0 in range(start, loop_end, BLOCK_N):
            tokens = n0 + tl.arange(0, BLOCK_N)
            token_mask = tokens < loop_end
            if not PAGES_EARLY:  # else looked up with the tile before (the first ones before the wait)
                pages = _tile_pages(page_table, slot, tokens, token_mask, stride_pt, tokens_per_page)
            k, v, k_scale, v_scale = _load_kv_tile_at(
                pages, k_cache, v_cache, k_scales, v_scales, tokens, token_mask, kv_head,
                stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
                stride_scale_head, tokens_per_page, HEAD_DIM, KIND)
            if PAGES_EARLY:
                pages = _tile_pages(page_table, slot, tokens + BLOCK_N, tokens + BLOCK_N < loop_end, stride_pt,
                                    tokens_per_page)
            s = tl.where(token_mask[None, :], _scores(q, k, k_scale, scale, KIND, PRECISION), float("-inf"))
            m_i, l_i, acc = _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND, PRECISION, False)
    if ROTARY:
        if holds_new:
            m_i, l_i, acc = _new_token_column(q, k_new, k_new_swapped, v_new, cos, sin, first_half, k_cache, v_cache,
                                              new_offs, scale, m_i, l_i, acc)
    empty = start >= length
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_i))
    out_offs = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    pdl_release(USE_PDL)
    if NUM_SPLITS > 1:  # one split: out_ptr is the final output and nothing is merged
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        counter = cnt_ptr + b * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1) == used - 1:  # the last used split of this row and KV head merges
            _merge_splits(out_ptr, lse_ptr, final_ptr, b, kv_head * GROUP, length, per_split,
                          stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                          GROUP, GROUP_P2, HEAD_DIM, SPLITS_PAD)
            _reset_ticket(counter)


@triton.jit
def _head_normed(x, x_swapped, w, w_swapped, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm of rows x [R, HEAD_DIM] and of the same rows with their halves exchanged (the rotary's
    partner columns), weights w / w_swapped at those columns: statistics in float32 over the row, (x rstd)
    rounded to x's dtype, times the weight, rounded (elementwise._head_rms_norm's arithmetic)."""
    dtype = x.dtype
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, 1) / HEAD_DIM + eps)[:, None]
    normed = (w.to(tl.float32) * (x32 * inv).to(dtype).to(tl.float32)).to(dtype)
    swapped = (w_swapped.to(tl.float32) * (x_swapped.to(tl.float32) * inv).to(dtype).to(tl.float32)).to(dtype)
    return normed, swapped


@triton.jit
def _new_token_column(q, k_new, k_new_swapped, v_new, cos, sin, first_half, k_cache, v_cache, new_offs, scale, m_i,
                      l_i, acc):
    """The step's token (ROTARY), from registers: k rotated, k and v into the cache, one softmax column added."""
    k_new = _rotated_rows(k_new, k_new_swapped, cos, sin, first_half)
    tl.store(k_cache + new_offs, k_new)
    tl.store(v_cache + new_offs, v_new)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
    m_new = tl.maximum(m_i, s_new)
    p_new = tl.exp(s_new - m_new)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new.to(q.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _kv_tile_to_l2(pages, k_cache, v_cache, tokens, token_mask, kv_head, stride_cache_page, stride_cache_token,
                   stride_cache_head, tokens_per_page, HEAD_DIM: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for a tile's K and V rows (`tokens` on their looked-up `pages`): one prefetch.global.L2 a 128-byte
    line, LINES a row, the masked tokens' skipped. A hint: nothing waits for it. Inline PTX: the launcher passes
    LINES 0 under the interpreter."""
    offs = (pages * stride_cache_page + (tokens % tokens_per_page) * stride_cache_token
            + kv_head * stride_cache_head)[:, None] + (tl.arange(0, LINES) * (HEAD_DIM // LINES))[None, :]
    k_lines = tl.where(token_mask[:, None], (k_cache + offs).to(tl.int64), 0)
    v_lines = tl.where(token_mask[:, None], (v_cache + offs).to(tl.int64), 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u64 p, $1, 0; @p prefetch.global.L2 [$1]; @p prefetch.global.L2 [$2]; "
        "mov.u32 $0, 0; }", "=r,l,l", [k_lines, v_lines], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _merge_splits(partial_ptr, lse_ptr, out_ptr, b, first_head, length, per_split,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Combine the non-empty splits' partial outputs of the GROUP heads by their log-sum-exp, all heads in one
    [heads, splits, dim] tile so their loads go out together (read past L1: other SMs wrote them)."""
    g = tl.arange(0, GROUP_P2)[:, None]
    s = tl.arange(0, SPLITS_PAD)[None, :]
    used = (s < tl.cdiv(length, tl.maximum(per_split, 1))) & (g < GROUP)  # [heads, splits]
    heads = first_head + g
    lse = tl.load(lse_ptr + b * stride_lb + heads * stride_lh + s, mask=used, other=float("-inf"),
                  cache_modifier=".cg")
    w = tl.where(used, tl.exp(lse - tl.max(lse, 1)[:, None]), 0.0)
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    parts = tl.load(partial_ptr + b * stride_pb + heads[:, :, None] * stride_ph + s[:, :, None] * stride_ps + d,
                    mask=used[:, :, None], other=0.0, cache_modifier=".cg")
    merged = tl.sum(parts * w[:, :, None], 1) / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]  # [heads, dim]
    out_offs = b * stride_ob + (first_head + tl.arange(0, GROUP_P2))[:, None] * stride_oh + d.reshape(1, HEAD_DIM)
    tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=(tl.arange(0, GROUP_P2) < GROUP)[:, None])


@triton.jit(do_not_specialize=["row_offset"])  # varies every step: no recompile per value class
def _prefill_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, page_table, out_ptr, query_starts, context_lens,
                    seg_slots, block_segments, block_starts,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cache_page, stride_cache_token, stride_cache_head,
                    stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                    scale, tokens_per_page, row_offset,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, KIND: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    block = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.load(block_segments + block)
    m_start = tl.load(block_starts + block)
    q_start = tl.load(query_starts + seg)
    q_len = tl.load(query_starts + seg + 1) - q_start
    context = tl.load(context_lens + seg)
    slot = tl.load(seg_slots + seg).to(tl.int64)
    kv_head = head // GROUP

    m = m_start + tl.arange(0, BLOCK_M)
    row_mask = m < q_len
    q_pos = context - q_len + m
    d = tl.arange(0, HEAD_DIM)
    rows = (row_offset + q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(context, context - q_len + m_start + BLOCK_M)
    # int8 under a 16-bit model: tiles dequantized to fp16 by _int8_tile (exact bytes, one multiply by the
    # scale) and fp16 dots, instead of int8 -> bf16 casts in the loop; q clamped to fp16's range once
    INT8_FP16: tl.constexpr = KIND == 1 and q_ptr.dtype.element_ty != tl.float32
    if INT8_FP16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    for n0 in range(0, kv_end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        allowed = (tokens[None, :] <= q_pos[:, None]) & token_mask[None, :]
        if INT8_FP16:
            k, v, k_scale, v_scale = _load_kv_tile(
                k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
                stride_scale_head, tokens_per_page, HEAD_DIM, KIND)
            s = tl.dot(q, tl.trans(_int8_tile(k, k_scale.to(tl.float16), False))) * scale
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = _softmax_update(s, _int8_tile(v, v_scale.to(tl.float16), False), v_scale, m_i, l_i,
                                            acc, q, 0, PRECISION, True)  # kind 0: V arrives scaled
        else:
            s, v, v_scale = _tile_scores(
                q, k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
                stride_scale_head, tokens_per_page, scale, HEAD_DIM, KIND, PRECISION)
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND, PRECISION, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _precision(q: torch.Tensor) -> str:
    """Exact float32 dot products for float32 models (Triton would use tf32); bf16/fp16 ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


# How many programs per SM the decode grid aims at: more splits make smaller work units, which balance batches of
# mixed lengths better but add a merge (in the last split's program). W1 (256 rows x 8 KV heads) runs one split
# at any value up to 8; W2 int4 at one row: 16 splits (the waves' count) 562.9 tok/s, 8 537.0, 4 522.4
# (fifteenth session).
DECODE_WAVES = 2
# Decode attention lets the next kernel launch only once its partial is stored (pdl_release). The next
# kernel (at batch 1 the int4 o_proj GEMV) requests its weights as it starts, megabytes that queue ahead of the
# attention's few latency-bound loads. W2 int4 (fused norms) on the H200: 542.0 tok/s releasing after the wait,
# 547.0 after the KV loop, 549.2 after the store; bf16 234.6 / 234.4 / 234.9 (fourteenth session, call 4). (An
# early first KV tile, requested before the wait, measured slower with it: 541.1 against 548.7, call 5.)
# On a float cache, decode rows skip the rotary + KV-write kernel: decode attention rotates q and the step's k
# (Qwen3's q/k norms first, QK_NORM, since the eleventh session: not yet measured) and writes k and v itself
# (_decode_split_kernel's ROTARY); prefill rows keep the kernel. And
# the first KV tile's page-table entries are read before the PDL wait (PAGES_EARLY, only where rows are split,
# so KV loops are short). On the H200, fifteenth session: W2 int4 554.9 tok/s with neither, 542.0 with the rotary
# alone (its KV loop then starts a page lookup later), 553.4 with the pages alone, 562.9 / 562.6 / 563.7 with
# both; bf16 232.8 -> 236.2 / 238.6. The first KV tile itself before the wait (the loop reads only settled
# positions then) measured slower: 559.5 / 560.6. W1 (one split, long loops) lost 10% with the pages early there
# too: 28.0k and 28.1k out tok/s against 31.1k and 31.3k.


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132, group: int = 1) -> int:
    """Enough splits that batch * kv_heads * splits fills the GPU DECODE_WAVES times: a power of two, at most
    32, and at most MERGE_TILE / group (the last split merges [group, splits, head_dim] in registers). Each
    value is a separately compiled kernel, so only six exist; graph capture compiles them all."""
    wanted = triton.cdiv(DECODE_WAVES * num_sms, max(1, batch * num_kv_heads))
    return min(32, max(1, MERGE_TILE // triton.next_power_of_2(group)), triton.next_power_of_2(wanted))


def kv_prefetch_lines(config: dict, head_dim: int, element_size: int, pages_early_float: bool,
                      asm: bool = INLINE_ASM) -> int:
    """The 128-byte lines of a KV row the decode kernel asks L2 for in its first tile before the wait
    (KV_PREFETCH_LINES): where `config` asks for it (SHORT_CONFIG's KV_PREFETCH), the pages are looked up early on a
    float cache, and inline PTX runs (not under the interpreter); else 0."""
    wanted = config.get("KV_PREFETCH") and pages_early_float and asm
    return max(1, head_dim * element_size // 128) if wanted else 0


MERGE_TILE = 64  # heads x splits the merging program holds at once (x head_dim fp32 values over its threads)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, config: dict | None = None,
                     rotary: tuple[torch.Tensor, ...] | None = None,
                     qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """q [B, H, D] over each request's first lengths[b] cached positions -> [B, H, D]. `config` overrides
    DECODE_CONFIG (benchmarks/tune_decode.py). With `rotary` = (k [B, KV heads, D], v, cos, sin) on a float
    cache, q and k are un-rotated and the step's position (lengths[b] - 1) is not in the cache yet: the kernel
    rotates q and k (rotate-half, the tables' rows by position) and writes k and v there; `qk_norm` = (q weight,
    k weight, eps) with it (Qwen3): q and k are RMS-normed per head first."""
    batch, num_heads, dim = q.shape
    config = default_decode_config(q, k_cache) if config is None else config
    kind, k_scales, v_scales, *scale_strides = scale_args(k_cache, k_scale, v_scale)
    if rotary is not None and kind != 0:
        raise ValueError("decode_attention's rotary takes a float cache")
    if qk_norm is not None and rotary is None:
        raise ValueError("decode_attention's qk_norm comes with rotary")
    k_new, v_new, cos, sin = rotary if rotary is not None else (q, q, q, q)
    q_norm_w, k_norm_w, norm_eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_splits == 1:  # the split kernel writes the output itself: no partials, no merge
        partial, lse = out.unsqueeze(2), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:  # the last split of each row and KV head merges them (a ticket from split_counters)
        partial = torch.empty((batch, num_heads, num_splits, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    counters = split_counters(q.device, batch * num_kv_heads)  # a dict lookup; read only with splits
    block_n = config["BLOCK_N"] if dim <= 128 else 32
    prefetch_lines = kv_prefetch_lines(config, dim, k_cache.element_size(), kind == 0 and num_splits > 1)
    loop = int8_path(q, config) if kind == 1 else ""
    # imma_t: heads as the mma's N side (no 16-row padding), one token sub-tile a warp
    group_pad = triton.next_power_of_2(group) if loop == "imma_t" else max(16, triton.next_power_of_2(group))
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, k_scales, v_scales, page_table, slots, lengths, partial, lse, out, counters,
        k_new, v_new, cos, sin, q_norm_w, k_norm_w, norm_eps,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *scale_strides, page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0), scale, k_cache.shape[1],
        GROUP=group, GROUP_PAD=group_pad, GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=dim, BLOCK_N=block_n, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        PRECISION=_precision(q), KIND=kind, INT8_LOOP=loop, INT8_SUB=int8_sub_tiles(block_n, config["num_warps"]),
        num_warps=config["num_warps"], num_stages=config["num_stages"], ROTARY=rotary is not None,
        KV_PREFETCH_LINES=prefetch_lines, QK_NORM=qk_norm is not None, **pdl_args())
    return out


def prefill_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, row_offset: int) -> None:
    """Every prefill chunk's queries (rows from `row_offset` on) attend causally over their pages."""
    num_blocks = meta.prefill_block_segments.shape[0]
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // cache.k.shape[2]
    kind, k_scales, v_scales, *scale_strides = scale_args(cache.k, cache.k_scale, cache.v_scale)
    _prefill_kernel[(num_blocks, num_heads)](
        q, cache.k, cache.v, k_scales, v_scales, meta.page_table, out, meta.prefill_query_starts,
        meta.prefill_context_lens, meta.prefill_slots, meta.prefill_block_segments, meta.prefill_block_starts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache.k.stride()[:3], *scale_strides, meta.page_table.stride(0),
        scale, cache.k.shape[1], row_offset,
        GROUP=group, HEAD_DIM=dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64, PRECISION=_precision(q), KIND=kind,
        num_warps=4, num_stages=2, **pdl_args())


class TritonAttention:
    name = "triton"
    supports_graphs = True
    prefill_block_m = PREFILL_BLOCK_M

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None and torch.cuda.is_available():
            num_sms = multiprocessors(torch.device("cuda", 0))
        self.num_sms = num_sms or 132
        self.graph_num_splits: int | None = None  # fixed while capturing a graph
        self.graph_decode_config: dict | None = None  # likewise (the short graph's SHORT_CONFIG)

    short_max_tokens = SHORT_MAX_TOKENS

    def short_decode(self, kv_cache_dtype: torch.dtype) -> bool:
        """Whether a single stream over at most short_max_tokens gets a step graph of its own (engine/graphs.py),
        whose decode attention runs inside short_decoding()."""
        return torch.empty((), dtype=kv_cache_dtype).element_size() == 2

    @contextlib.contextmanager
    def short_decoding(self):
        """Decode attention at SHORT_SPLITS splits of SHORT_CONFIG inside (the short graph's step)."""
        saved = self.graph_num_splits, self.graph_decode_config
        self.graph_num_splits, self.graph_decode_config = SHORT_SPLITS, SHORT_CONFIG
        try:
            yield
        finally:
            self.graph_num_splits, self.graph_decode_config = saved

    fuses_rotary = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, cache.k, cache.v, meta.page_table, meta.token_slots, meta.positions,
                 cache.k_scale, cache.v_scale)
        return self._attend(q, cache, meta, scale)

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                       qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """forward() for un-rotated q and k: the rotary embedding (and Qwen3's q/k norms, `qk_norm`) is
        applied while writing the cache; on a float cache decode attention does it (norms too) for the decode
        rows."""
        nd = meta.num_decode_tokens
        if not (nd and cache.k_scale is None):
            rotary_write_kv(q, k, v, cache, cos, sin, meta, qk_norm)
            return self._attend(q, cache, meta, scale)
        rotary_write_kv(q, k, v, cache, cos, sin, meta, qk_norm, first_row=nd)  # the prefill rows
        return self._attend(q, cache, meta, scale, rotary=(k[:nd], v[:nd], cos, sin), qk_norm=qk_norm)

    def _attend(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                rotary: tuple[torch.Tensor, ...] | None = None,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """Decode rows, then prefill rows; `rotary`, `qk_norm`: decode_attention's, for the decode rows."""
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            num_kv_heads = cache.k.shape[2]
            splits = self.graph_num_splits or decode_num_splits(nd, num_kv_heads, self.num_sms,
                                                                q.shape[1] // num_kv_heads)
            decode_attention(q[:nd], cache.k, cache.v, meta.page_table, meta.decode_slots, meta.decode_lengths,
                             scale, splits, out=out[:nd], k_scale=cache.k_scale, v_scale=cache.v_scale,
                             config=self.graph_decode_config, rotary=rotary, qk_norm=qk_norm)
        if meta.prefill_block_segments is not None:  # set whenever the step has prefill chunks
            prefill_attention(q, cache, meta, scale, out, row_offset=nd)
        return out
