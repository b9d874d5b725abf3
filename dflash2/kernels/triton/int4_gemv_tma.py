"""The persistent int4 decode GEMV with its weights streamed by the tensor-memory accelerator (config "TMA").

The persistent kernel in int4_gemv.py holds the next tile's words in registers (one tile ahead), so the bytes
an SM keeps in flight are bounded by its register file: gate_up (llama-3-8b, RMSNorm folded in) fits 4 programs
an SM at 128 registers, about 64 KiB in flight. Here the words of each tile come through a TMA descriptor
load inside a `tl.range(..., num_stages=TMA)` loop: Triton's pipeliner turns it into TMA copies to shared
memory with mbarriers, TMA - 1 tiles ahead, and the scales into cp.async copies; the registers hold only the
tile being computed (56-64 a thread at 8 rows), and shared memory holds the tiles in flight (20 KiB a tile of
8 rows on 4 warps). The arithmetic, the norm and the stores are the persistent kernel's.

The descriptor views the repacked words [N, K / 8] as [N, K / 8 / BOX_WORDS, BOX_WORDS] with blocks of a step's
[BLOCK_N, 4 CHUNKS / BOX_WORDS, BOX_WORDS] (words_descriptor; box rows of up to 1 KiB, which Triton lays out
128-byte swizzled); each thread reads its own chunk of every row from shared memory (one 16-byte load a row);
rows and chunks past the tensor are zero-filled by the TMA unit (and their activations masked to zero). L2_FIRST: before its PDL wait a program asks L2 for its first
tile (gemv_parts._l2_prefetch), in place of the persistent kernel's early loads into registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import _l2_prefetch
from dflash2.kernels.triton.int4_gemv import _int4_store
from dflash2.kernels.triton.int4_math import (_norm_weight_slots, _rms_rstd, _slot_activations, _slots_normed_by,
                                              _step_from_activations, _step_sum, _sum_squares)
from dflash2.kernels.triton.pdl import pdl_start


@triton.jit
def _int4_gemv_tma_kernel(x_ptr, w_desc, w_ptr, sz_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                          stride_om, nw_ptr, eps, GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CHUNKS: tl.constexpr, STEPS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_M: tl.constexpr,
                          EVEN_K: tl.constexpr, ASM: tl.constexpr, PAIRED: tl.constexpr, SILU_OUT: tl.constexpr,
                          HALF2: tl.constexpr, USE_PDL: tl.constexpr, STAGES: tl.constexpr,
                          L2_FIRST: tl.constexpr, NORM: tl.constexpr, ADD_OUT: tl.constexpr,
                          ONE_PLUS: tl.constexpr, BOX_WORDS: tl.constexpr):
    """int4_gemv.py's persistent kernel (program p takes tiles p, p + P, ...; each in STEPS steps along K) with
    the words of every (tile, step) loaded through w_desc, pipelined STAGES deep (see the module docstring).
    w_ptr: the same words as a pointer (L2_FIRST's prefetch)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    STEP: tl.constexpr = CHUNKS * 32
    MASKED: tl.constexpr = not (EVEN_K and EVEN_M)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, programs) * STEPS  # this program's (tile, step) pairs
    lanes = tl.arange(0, BLOCK_N)
    m_idx = tl.arange(0, BLOCK_M)
    m_ok = m_idx < M
    c = tl.arange(0, CHUNKS)
    c4 = c[:, None, None, None]
    j4 = tl.arange(0, 4)[None, None, None, :]
    x_base = x_ptr + m_idx[None, :, None, None] * stride_xm  # [1, BM, 1, 1]
    x_cols = c4 * 32 + j4  # [C, 1, 1, 4]; + 4 p for slot p
    if L2_FIRST:  # the first tile's words and scales (never written by a kernel) while the previous one ends
        r0 = pid * BLOCK_N
        rows_here = tl.minimum(N - r0, BLOCK_N)
        _l2_prefetch(w_ptr + r0 * stride_wn, rows_here * stride_wn, ASM)
        _l2_prefetch(sz_ptr + r0 * stride_sn, rows_here * stride_sn, ASM)
    if NORM and STEPS == 1:  # the norm weights are constants: requested before the wait
        w0, w1, w2, w3, w4, w5, w6, w7 = _norm_weight_slots(nw_ptr, x_cols, c4 * 32 < K)
    pdl_start(USE_PDL)
    if STEPS == 1:
        x_mask = (c4 * 32 < K) & m_ok[None, :, None, None]
        x0, x1, x2, x3, x4, x5, x6, x7 = _slot_activations(x_base, x_cols, x_mask, K, SILU_MUL, MASKED, ASM)
        if NORM:
            rstd = tl.rsqrt(_sum_squares(x0, x1, x2, x3, x4, x5, x6, x7) / K + eps)
            x0, x1, x2, x3, x4, x5, x6, x7 = _slots_normed_by(x0, x1, x2, x3, x4, x5, x6, x7, rstd, w0, w1, w2, w3,
                                                              w4, w5, w6, w7, x_ptr.dtype.element_ty)
    elif NORM:
        rstd = _rms_rstd(x_base, x_cols, m_ok, K, eps, STEP, ASM)
    else:
        rstd = eps  # (unused without NORM)
    acc = tl.zeros([CHUNKS, BLOCK_M, BLOCK_N], tl.float32)
    for f in tl.range(0, total, num_stages=STAGES):
        tile = pid + (f // STEPS) * programs
        k0 = (f % STEPS) * STEP
        block = w_desc.load([tile * BLOCK_N, k0 // (8 * BOX_WORDS), 0])  # [BN, 4 CHUNKS / BOX_WORDS, BOX_WORDS]
        words = tl.permute(tl.reshape(block, [BLOCK_N, CHUNKS, 4]), (1, 0, 2))[:, None, :, :]  # [C, 1, BN, 4]
        rows = tile * BLOCK_N + lanes
        n_ok = rows < N
        c_ok = k0 + c * 32 < K
        sz = tl.load(sz_ptr + tl.where(n_ok, rows, 0)[None, None, :] * stride_sn + (k0 + c[:, None, None] * 32) // GS,
                     mask=c_ok[:, None, None] & n_ok[None, None, :], other=0)
        if STEPS == 1:
            part = _step_sum(words, sz, x0, x1, x2, x3, x4, x5, x6, x7, HALF2, ASM, ONE_PLUS)
            _int4_store(tl.sum(part, axis=0), tile, out_ptr, out_ptr, out_ptr, m_idx, M, N, stride_om, 0, BLOCK_M,
                        BLOCK_N, 1, PAIRED, SILU_OUT, ADD_OUT)
        else:
            c_ok4 = c_ok[:, None, None, None]
            acc += _step_from_activations(words, sz, x_base, k0 + x_cols, c_ok4 & m_ok[None, :, None, None], c_ok4,
                                          K, rstd, nw_ptr, SILU_MUL, MASKED, NORM, HALF2, ASM, ONE_PLUS)
            if k0 + STEP >= K:
                _int4_store(tl.sum(acc, axis=0), tile, out_ptr, out_ptr, out_ptr, m_idx, M, N, stride_om, 0,
                            BLOCK_M, BLOCK_N, 1, PAIRED, SILU_OUT, ADD_OUT)
                acc = tl.zeros([CHUNKS, BLOCK_M, BLOCK_N], tl.float32)


def box_words(k: int, chunks: int) -> int:
    """Words a row of a descriptor box spans: the most (at most 256, the TMA limit) that divide both a step's
    4 CHUNKS words and the row's K / 8, so that a step is whole boxes of the row; at least one chunk's 4 words.
    A wide box matters: with 16-byte rows the copy unit moves 16 bytes a request and cannot keep up."""
    box = 256
    while box > 4 and ((4 * chunks) % box or (k // 8) % box):
        box //= 2
    return box


def words_descriptor(weight: dict, block_n: int, chunks: int):
    """The TMA descriptor of a prepare_int4 weight's words, viewed as [N, K / 8 / box, box] with blocks of
    [block_n, 4 chunks / box, box] (box = box_words), built once a weight and block shape (kept in its dict)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cache = weight.setdefault("tma_descriptors", {})
    key = (block_n, chunks)
    if key not in cache:
        words, n, k = weight["words"], weight["n"], weight["k"]
        if words.stride() != (k // 8, 1):
            raise ValueError(f"int4 GEMV TMA needs contiguous words [{n}, {k // 8}], got strides {words.stride()}")
        box = box_words(k, chunks)
        cache[key] = TensorDescriptor(words, [n, k // 8 // box, box], [k // 8, box, 1], [block_n, 4 * chunks // box, box])
    return cache[key]
