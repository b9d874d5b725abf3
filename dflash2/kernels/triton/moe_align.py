"""The fused MoE's first step (kernels/triton/fused_moe.py): the router's (token, slot) pairs sorted by expert into
blocks of BLOCK_M rows, each expert's rows padded to whole blocks, on the device.

    pair p = t * k + j  (token t, slot j of topk_ids [T, k])

    rows      | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | -- -- -- -- |   (BLOCK_M = 4, "--": padding)
    block     |     0       |     1       |     2       |     3       |     4       |
    experts   |     0       |     2       |     2       |     5       |    -1       |   (-1: past the used blocks)

`pair_ids[row]` is the pair a row holds, or `num_pairs` (out of range) on a padding row; within an expert the
pairs keep their order. A block never mixes experts, so a GEMM program reads one expert's weights for a whole
block. The number of rows has a static bound, max_rows(), which depends only on T, k, E and BLOCK_M: no host sync,
and the same launch shapes every call, so the step can be captured in a CUDA graph. Blocks past the used ones are
marked -1, and the GEMMs skip them.

Two kernels of `num_chunks` programs, each owning PAIRS_PER_PROGRAM consecutive pairs (one program, one kernel
when they fit in one chunk, as in decode):
    _count_kernel    the chunk's pairs per expert -> counts [num_chunks, BLOCK_E]
    _scatter_kernel  every expert's total and the counts of the chunks before this one -> each pair's row;
                     then every num_chunks-th block: its expert, and the sentinel on its padding rows
The rank of a pair among the chunk's pairs of its expert is a cumulative sum of one-hot rows [SUB, BLOCK_E]
(SUB pairs a step, ONE_HOT_ELEMENTS in all).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.pdl import pdl_args, pdl_start

PAIRS_PER_PROGRAM = 512  # a chunk
ONE_HOT_ELEMENTS = 8192  # a step's one-hot [SUB, BLOCK_E]: 64 int32 registers a thread of 4 warps
CHUNK_ROWS = 32  # rows of the counts table a step
BLOCKS_A_STEP = 16


class ExpertBlocks(NamedTuple):
    """The sorted layout (module docstring), all on the device."""

    pair_ids: torch.Tensor  # [max_rows] int32: t * k + j, or num_pairs on padding rows
    block_experts: torch.Tensor  # [max_rows / BLOCK_M] int32: the expert of each block, -1 past the used ones
    num_rows: torch.Tensor  # [1] int32: rows in the used blocks


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout: every pair, plus at most BLOCK_M - 1 padding rows for each expert that has any
    (at most min(E, T k) of them), in whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _one_hot(ids, experts):
    return (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _chunk_counts(ids_ptr, chunk, num_pairs, experts, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    counts = tl.zeros([BLOCK_E], tl.int32)
    for step in range(0, tl.minimum(CHUNK, num_pairs - chunk * CHUNK), SUB):
        pairs = chunk * CHUNK + step + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum(_one_hot(ids, experts), axis=0)
    return counts


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                  USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = _chunk_counts(ids_ptr, chunk, num_pairs, experts, CHUNK, SUB, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + experts, counts)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, pair_ids_ptr, block_experts_ptr, num_rows_ptr, num_pairs, num_chunks,
                    num_blocks, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_M: tl.constexpr, TABLE_ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                    ONE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    # 1. pairs per expert in all chunks, and in the chunks before this one
    if ONE_CHUNK:
        totals = _chunk_counts(ids_ptr, chunk, num_pairs, experts, CHUNK, SUB, BLOCK_E)
        before = tl.zeros([BLOCK_E], tl.int32)
    else:
        totals = tl.zeros([BLOCK_E], tl.int32)
        before = tl.zeros([BLOCK_E], tl.int32)
        for first in range(0, num_chunks, TABLE_ROWS):
            chunks = first + tl.arange(0, TABLE_ROWS)
            table = tl.load(counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :],
                            mask=(chunks < num_chunks)[:, None], other=0)
            totals += tl.sum(table, axis=0)
            before += tl.sum(tl.where((chunks < chunk)[:, None], table, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # 2. this chunk's pairs: the expert's first row + the pairs of that expert before them
    running = starts + before
    for step in range(0, tl.minimum(CHUNK, num_pairs - chunk * CHUNK), SUB):
        pairs = chunk * CHUNK + step + tl.arange(0, SUB)
        ok = pairs < num_pairs
        hot = _one_hot(tl.load(ids_ptr + pairs, mask=ok, other=-1).to(tl.int32), experts)
        rows = tl.sum(hot * (tl.cumsum(hot, axis=0) - hot + running[None, :]), axis=1)
        tl.store(pair_ids_ptr + rows, pairs, mask=ok)
        running += tl.sum(hot, axis=0)
    # 3. every num_chunks-th block: its expert (the first whose rows end past the block's first row), sentinels
    used_rows = tl.sum(padded, axis=0)
    for first in range(chunk * BLOCKS, num_blocks, num_chunks * BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        first_rows = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_rows[:, None]).to(tl.int32), axis=1)
        in_range = blocks < num_blocks
        tl.store(block_experts_ptr + blocks, tl.where(first_rows < used_rows, owner, -1), mask=in_range)
        owned = (owner[:, None] == experts[None, :]).to(tl.int32)  # none past the used blocks
        owner_start = tl.sum(owned * starts[None, :], axis=1)
        owner_count = tl.sum(owned * totals[None, :], axis=1)
        rows = first_rows[:, None] + tl.arange(0, BLOCK_M)[None, :]
        padding = (rows - owner_start[:, None] >= owner_count[:, None]) & in_range[:, None]
        tl.store(pair_ids_ptr + rows, tl.zeros([BLOCKS, BLOCK_M], tl.int32) + num_pairs, mask=padding)
    if chunk == 0:
        tl.store(num_rows_ptr, used_rows)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    pairs_per_program: int = PAIRS_PER_PROGRAM) -> ExpertBlocks:
    """topk_ids [T, k] (int32 or int64, each in [0, num_experts)) -> the sorted layout (module docstring).
    pairs_per_program: a power of two (smaller in tests, to run several chunks)."""
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    num_pairs = ids.numel()
    rows = max_rows(num_pairs, num_experts, block_m)
    device = ids.device
    pair_ids = torch.empty(rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return ExpertBlocks(pair_ids, block_experts, num_rows.zero_())
    num_chunks = triton.cdiv(num_pairs, pairs_per_program)
    block_e = triton.next_power_of_2(num_experts)
    sub = min(pairs_per_program, max(16, ONE_HOT_ELEMENTS // block_e))
    counts = pair_ids  # unused with one chunk
    if num_chunks > 1:
        counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](ids, counts, num_pairs, CHUNK=pairs_per_program, SUB=sub, BLOCK_E=block_e,
                                     **pdl_args())
    _scatter_kernel[(num_chunks,)](
        ids, counts, pair_ids, block_experts, num_rows, num_pairs, num_chunks, rows // block_m,
        CHUNK=pairs_per_program, SUB=sub, BLOCK_E=block_e, BLOCK_M=block_m, TABLE_ROWS=CHUNK_ROWS,
        BLOCKS=BLOCKS_A_STEP, ONE_CHUNK=num_chunks == 1, **pdl_args())
    return ExpertBlocks(pair_ids, block_experts, num_rows)
