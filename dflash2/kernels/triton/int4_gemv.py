"""Decode GEMV for int4 weights (M <= 4 activation rows), built to stay memory-bound on Hopper.

At 4 bits a weight the bytes are so few that instructions, not bandwidth, limit a plain kernel: an H200
issues about 4 thread-instructions per weight at full bandwidth. This one spends about 3 (M = 1) with float32
products and about 2-2.5 with the packed fp16 products that 16-bit models use (HALF2); the layout and the
arithmetic are in int4_math.py.

Threads and reductions: a program holds BLOCK_N rows and CHUNKS chunks (32 CHUNKS columns) per step along K;
with CHUNKS = 32 num_warps every thread owns one chunk of every row of the block, so all tensors share one
blocked layout (no data crosses threads inside the K loop) and the reduction over K runs once, at the end.
SPLIT_K > 1 splits K over programs (gemv_parts._store_or_reduce: the last one sums the partials). The
persistent kernel walks several row tiles a program instead (config "PERSISTENT").
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.elementwise import _silu_mul
from dflash2.kernels.triton.gemv_parts import (_added, _k_range, _l2_prefetch, _store_or_reduce, multiprocessors,
                                               prepare_io, split_counters)
from dflash2.kernels.triton.int4_configs import int4_config
from dflash2.kernels.triton.int4_math import (CHUNK, HALF2_SLOT_BITS, SLOT_BITS,
                                              _norm_weight_slots, _rms_rstd, _slot_activations, _slots_normed_by,
                                              _step_from_activations, _step_sum, _sum_squares, repack_int4)
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Measured on the H200 (W2 int4, tok/s): each program requests its first step's weights before its PDL wait,
# 475.9 against 467.4 (eleventh session); a decoder layer whose four linears run this GEMV folds its two RMSNorms
# into the GEMVs that read them (qkv, gate_up: norm=) and its two residual adds into the GEMVs that produce them
# (o_proj, down: add_out), two launches a layer fewer (models/llama.py), 542.0 against 527.5 (fourteenth); where
# K takes several steps (down: 4) each program of the regular kernel asks L2 for all of its rows right after its
# wait (its registers hold one step ahead, so each later step's words would otherwise come a loaded HBM latency
# after it asks), 575.3 against 562.9 (eighteenth; before the wait, line by line, or tiles ahead in the
# persistent kernel it measured slower).


@triton.jit
def _load_step(w_base, sz_base, k0, k_end, c, n_ok, GS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
               BEYOND: tl.constexpr):
    """The words [C, 1, BN, 4] and scale/zero pairs [C, 1, BN] of the step at column k0. BEYOND: k0 may be
    past k_end (a prefetch after the last step), so the loads need their masks even for an even K."""
    c_ok = k0 + c * 32 < k_end
    g = (k0 + c[:, None, None] * 32) // GS  # [C, 1, 1]
    if EVEN_K and EVEN_N and not BEYOND:
        words = tl.load(w_base + k0 // 8)
        sz = tl.load(sz_base + g)
    else:
        words = tl.load(w_base + k0 // 8, mask=c_ok[:, None, None, None] & n_ok[None, None, :, None], other=0)
        sz = tl.load(sz_base + g, mask=c_ok[:, None, None] & n_ok[None, None, :], other=0)
    return words, sz


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                      stride_sn, stride_om, nw_ptr, eps, GS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                      ASM: tl.constexpr, PAIRED: tl.constexpr, SILU_OUT: tl.constexpr, USE_PDL: tl.constexpr,
                      HALF2: tl.constexpr = False, NORM: tl.constexpr = False, ADD_OUT: tl.constexpr = False,
                      ONE_STEP: tl.constexpr = False, ADD_EARLY: tl.constexpr = False):
    """out[m, n] = sum_k (q - z) s x for every row m < M. The 4-D tensors are (chunk, m, n, word): the chunk
    axis first, so that Triton's coalescing (which orders equally non-contiguous axes by index) spreads the
    threads over the chunks and leaves each thread all the rows. sz: int32 [N, K / GS], the fp16 scale in the
    low half and the fp16 zero in the high half. Offsets are int32 (the launcher checks they fit).
    The first step's words and scales are requested before the wait for the previous kernel (programmatic
    dependent launch), which never writes them, so they stream in while it finishes. PREFETCH (K takes more
    than one step): the words and scales of step i + 1 are requested before step i is computed (registers for
    one more step), and with SPLIT_K = 1 the program asks L2 for all of its rows' words and scales right after
    the wait.
    PAIRED: the weight is a [gate | up] pair with its rows interleaved (pair_gate_up: row 2i is gate row i, row
    2i + 1 up row i); the outputs go back to [gate | up] order, or with SILU_OUT (SPLIT_K = 1) a program stores
    silu(gate) * up of its BLOCK_N / 2 pairs, rounded as the separate silu_and_mul kernel would.
    NORM: x is the residual stream, and the GEMV's input is its RMSNorm with weight nw (rms_norm's arithmetic;
    every program computes the rows' statistics in a pass over x first, or from the step's activations when
    ONE_STEP: all of K in one step, SPLIT_K = 1). ADD_OUT: out += the result (the residual add: the product
    rounded to out's dtype, then added in float32). ADD_EARLY (ADD_OUT, SPLIT_K = 1): out was last
    written two or more launches back (pdl.py's rule), so its tile is read before the wait, with the first
    weights, not after the K loop; with ONE_STEP the norm weights are read there too (constants)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    STEP: tl.constexpr = CHUNKS * 32
    k_start, k_end = _k_range(K, pid_k, STEP, SPLIT_K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    if not EVEN_N:
        rows = tl.where(n_ok, rows, 0)
    m_idx = tl.arange(0, BLOCK_M)
    m_ok = m_idx < M
    c = tl.arange(0, CHUNKS)
    c4 = c[:, None, None, None]
    j4 = tl.arange(0, 4)[None, None, None, :]
    w_base = w_ptr + (rows[None, None, :, None] * stride_wn + c4 * 4 + j4)  # [C, 1, BN, 4]
    x_base = x_ptr + m_idx[None, :, None, None] * stride_xm  # [1, BM, 1, 1]
    x_cols = c4 * 32 + j4  # [C, 1, 1, 4]; + 4 p for slot p
    sz_base = sz_ptr + rows[None, None, :] * stride_sn  # [1, 1, BN]
    acc = tl.zeros([CHUNKS, BLOCK_M, BLOCK_N], tl.float32)
    words_next, sz_next = _load_step(w_base, sz_base, k_start, k_end, c, n_ok, GS, EVEN_N, EVEN_K, False)
    if NORM and ONE_STEP:
        c_ok1 = c4 * 32 < K
        w0, w1, w2, w3, w4, w5, w6, w7 = _norm_weight_slots(nw_ptr, x_cols, c_ok1)
    prior = eps  # (unused without ADD_EARLY)
    if ADD_EARLY:
        cols = _out_cols(pid, N, BLOCK_N, PAIRED)
        prior = tl.load(out_ptr + m_idx[:, None] * stride_om + cols[None, :],
                        mask=m_ok[:, None] & (cols < N)[None, :], other=0.0)
    pdl_start(USE_PDL)
    if PREFETCH and SPLIT_K == 1:  # prepare_int4's rows follow each other: one range of words, one of scales
        r0 = pid * BLOCK_N
        rows_here = tl.minimum(N - r0, BLOCK_N)
        _l2_prefetch(w_ptr + r0 * stride_wn, rows_here * stride_wn, ASM)
        _l2_prefetch(sz_ptr + r0 * stride_sn, rows_here * stride_sn, ASM)
    MASKED: tl.constexpr = not (EVEN_K and EVEN_M)
    rstd = eps  # (unused without NORM)
    if NORM and ONE_STEP:  # the whole row is this step's activations: normed once, before the loop
        x0, x1, x2, x3, x4, x5, x6, x7 = _slot_activations(x_base, x_cols, c_ok1 & m_ok[None, :, None, None], K,
                                                           False, MASKED, ASM)
        rstd = tl.rsqrt(_sum_squares(x0, x1, x2, x3, x4, x5, x6, x7) / K + eps)
        x0, x1, x2, x3, x4, x5, x6, x7 = _slots_normed_by(x0, x1, x2, x3, x4, x5, x6, x7, rstd, w0, w1, w2, w3, w4,
                                                          w5, w6, w7, x_ptr.dtype.element_ty)
    elif NORM:
        rstd = _rms_rstd(x_base, x_cols, m_ok, K, eps, STEP, ASM)
    for k0 in range(k_start, k_end, STEP):
        c_ok = k0 + c * 32 < k_end
        c_ok4 = c_ok[:, None, None, None]
        words, sz = words_next, sz_next  # requested with the step before (the first one before the wait)
        if PREFETCH:  # ask for the next step's now
            words_next, sz_next = _load_step(w_base, sz_base, k0 + STEP, k_end, c, n_ok, GS, EVEN_N, EVEN_K, True)
        if NORM and ONE_STEP:  # the activations were loaded and normed before the loop
            acc += _step_sum(words, sz, x0, x1, x2, x3, x4, x5, x6, x7, HALF2, ASM)
        else:
            acc += _step_from_activations(words, sz, x_base, k0 + x_cols, c_ok4 & m_ok[None, :, None, None], c_ok4,
                                          K, rstd, nw_ptr, SILU_MUL, MASKED, NORM, HALF2, ASM)
    _int4_store(tl.sum(acc, axis=0), pid, out_ptr, ws_ptr, cnt_ptr, m_idx, M, N, stride_om, pid_k, BLOCK_M, BLOCK_N,
                SPLIT_K, PAIRED, SILU_OUT, ADD_OUT, prior, ADD_EARLY)


@triton.jit
def _int4_store(result, tile, out_ptr, ws_ptr, cnt_ptr, m_idx, M, N, stride_om, pid_k, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, PAIRED: tl.constexpr, SILU_OUT: tl.constexpr,
                ADD_OUT: tl.constexpr = False, prior=0.0, ADD_EARLY: tl.constexpr = False):
    """Store tile `tile`'s [BM, BN] result (or its split-K partial): PAIRED rows back in [gate | up] order, or
    with SILU_OUT silu(gate) * up of its BLOCK_N / 2 pairs; ADD_OUT: added to what out holds (ADD_EARLY: to
    `prior`, the tile of out read before the loop)."""
    if SILU_OUT:
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(result, [BLOCK_M, BLOCK_N // 2, 2]))
        pairs = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = (m_idx < M)[:, None] & (pairs < N // 2)[None, :]
        # the outputs rounded as the unfused GEMV would have stored them, then silu_and_mul's rounding
        tl.store(out_ptr + m_idx[:, None] * stride_om + pairs[None, :], _silu_mul(gate.to(dtype), up.to(dtype)),
                 mask=mask)
    elif ADD_EARLY:  # SPLIT_K = 1
        cols = _out_cols(tile, N, BLOCK_N, PAIRED)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + m_idx[:, None] * stride_om + cols[None, :], _added(result, prior, dtype).to(dtype),
                 mask=(m_idx < M)[:, None] & (cols < N)[None, :])
    else:
        _store_or_reduce(result, out_ptr, ws_ptr, cnt_ptr, m_idx, _out_cols(tile, N, BLOCK_N, PAIRED), M, N,
                         stride_om, tile, pid_k, SPLIT_K, ADD_OUT)


@triton.jit
def _out_cols(tile, N, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr):
    """The output columns of tile `tile`'s rows: PAIRED (interleaved gate i, up i) back in [gate | up] order;
    rows past N stay past N (masked)."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if PAIRED:
        cols = tl.where(cols < N, (cols % 2) * (N // 2) + cols // 2, cols)
    return cols


@triton.jit
def _tile_step_load(w_ptr, sz_ptr, tile, k0, N, K, c, lanes, offs, stride_wn, stride_sn, GS: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The words [C, 1, BN, 4] and scale/zero pairs [C, 1, BN] of row tile `tile` at column k0, masked (a tile
    past the last one loads nothing: the persistent kernel's prefetch after its last step)."""
    rows = tile * BLOCK_N + lanes
    n_ok = rows < N
    rows = tl.where(n_ok, rows, 0)
    c_ok = k0 + c * 32 < K
    words = tl.load(w_ptr + rows[None, None, :, None] * stride_wn + k0 // 8 + offs,
                    mask=c_ok[:, None, None, None] & n_ok[None, None, :, None], other=0)
    g = (k0 + c[:, None, None] * 32) // GS
    sz = tl.load(sz_ptr + rows[None, None, :] * stride_sn + g, mask=c_ok[:, None, None] & n_ok[None, None, :],
                 other=0)
    return words, sz


@triton.jit
def _int4_gemv_persistent_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                                 stride_om, nw_ptr, eps, GS: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, STEPS: tl.constexpr,
                                 SILU_MUL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                                 PAIRED: tl.constexpr, SILU_OUT: tl.constexpr, HALF2: tl.constexpr,
                                 USE_PDL: tl.constexpr, NORM: tl.constexpr = False, ADD_OUT: tl.constexpr = False):
    """The same GEMV with fewer programs than row tiles (int4_gemv's config "PERSISTENT"): program p takes tiles
    p, p + P, p + 2 P, ... (P programs), each in STEPS steps along K, and requests the next step's words (the
    next tile's, after a tile's last step) before it computes this one, so its loads keep streaming while it
    computes, and no wave of programs ends half-empty. With one step a tile (K <= 32 CHUNKS) the activations
    are loaded once, before the loop (and with NORM normed once, the norm weights requested with the first
    words), the first words before the PDL wait. NORM, ADD_OUT: as in _int4_gemv_kernel."""
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
    offs = c4 * 4 + j4  # [C, 1, 1, 4]: a chunk's 4 words
    x_base = x_ptr + m_idx[None, :, None, None] * stride_xm  # [1, BM, 1, 1]
    x_cols = c4 * 32 + j4  # [C, 1, 1, 4]; + 4 p for slot p
    words_next, sz_next = _tile_step_load(w_ptr, sz_ptr, pid, 0, N, K, c, lanes, offs, stride_wn, stride_sn, GS,
                                          BLOCK_N)
    if NORM and STEPS == 1:  # the norm weights are constants: requested with the first words
        w0, w1, w2, w3, w4, w5, w6, w7 = _norm_weight_slots(nw_ptr, x_cols, c4 * 32 < K)
    pdl_start(USE_PDL)
    if STEPS == 1:
        c_ok4 = c4 * 32 < K
        x_mask = c_ok4 & m_ok[None, :, None, None]
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
    for f in range(0, total):
        tile = pid + (f // STEPS) * programs
        k0 = (f % STEPS) * STEP
        words, sz = words_next, sz_next
        words_next, sz_next = _tile_step_load(w_ptr, sz_ptr, pid + ((f + 1) // STEPS) * programs,
                                              ((f + 1) % STEPS) * STEP, N, K, c, lanes, offs, stride_wn, stride_sn,
                                              GS, BLOCK_N)
        if STEPS == 1:
            part = _step_sum(words, sz, x0, x1, x2, x3, x4, x5, x6, x7, HALF2, ASM)
            _int4_store(tl.sum(part, axis=0), tile, out_ptr, out_ptr, out_ptr, m_idx, M, N, stride_om, 0, BLOCK_M,
                        BLOCK_N, 1, PAIRED, SILU_OUT, ADD_OUT)
        else:
            c_ok4 = k0 + c4 * 32 < K
            acc += _step_from_activations(words, sz, x_base, k0 + x_cols, c_ok4 & m_ok[None, :, None, None], c_ok4,
                                          K, rstd, nw_ptr, SILU_MUL, MASKED, NORM, HALF2, ASM)
            if k0 + STEP >= K:
                _int4_store(tl.sum(acc, axis=0), tile, out_ptr, out_ptr, out_ptr, m_idx, M, N, stride_om, 0,
                            BLOCK_M, BLOCK_N, 1, PAIRED, SILU_OUT, ADD_OUT)
                acc = tl.zeros([CHUNKS, BLOCK_M, BLOCK_N], tl.float32)


def prepare_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 half2: bool = True) -> dict:
    """Device tensors for the kernel: the repacked words (half2: in the HALF2 layout, for packed fp16 products:
    16-bit models; else the float32 products' layout: float32 models); scales and zeros as stored."""
    if group_size % CHUNK:
        raise ValueError(f"int4 GEMV needs a group size divisible by {CHUNK}, got {group_size}")
    split_counters(qweight.device, 1 << 16)  # allocated now, not inside a graph capture
    if scales.dtype != torch.float16 or zeros.dtype != torch.float16:
        raise ValueError(f"int4 GEMV needs float16 scales and zeros, got {scales.dtype} and {zeros.dtype}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if n * k // 8 >= 1 << 31:
        raise ValueError(f"int4 GEMV indexes with int32 offsets: [{n}, {k}] is too large")
    pairs = torch.stack((scales.contiguous().view(torch.int16), zeros.contiguous().view(torch.int16)), dim=-1)
    words = repack_int4(qweight, slot_bits=HALF2_SLOT_BITS if half2 else SLOT_BITS)
    return {"words": words, "sz": pairs.view(torch.int32).reshape(n, -1).contiguous(),
            "group_size": group_size, "n": n, "k": k, "half2": half2}


def pair_gate_up(weight: dict) -> dict:
    """A prepare_int4 weight whose rows are [gate | up] (N = 2 I), with its rows interleaved (gate i, up i) so
    that one program holds both halves of its outputs (int4_gemv's silu_out); outputs keep [gate | up] order."""
    n = weight["n"]
    if n % 2:
        raise ValueError(f"a [gate | up] weight has an even number of rows, got {n}")

    def interleave(t: torch.Tensor) -> torch.Tensor:
        return torch.stack((t[: n // 2], t[n // 2:]), dim=1).reshape(n, -1).contiguous()

    return {**weight, "words": interleave(weight["words"]), "sz": interleave(weight["sz"]), "paired": True}


def int4_gemv(x: torch.Tensor, weight: dict, out: torch.Tensor | None = None, silu_mul: bool = False,
              config: dict | None = None, silu_out: bool = False,
              norm: tuple[torch.Tensor, float] | None = None, add_out: bool = False,
              out_settled: bool = False) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul; M small) @ W^T for a weight from prepare_int4; with silu_out (a
    pair_gate_up weight) silu(gate) * up of that product, [M, N / 2]. norm = (weight [K], eps): the input is
    RMSNorm(x) as rms_norm computes it (x: the residual stream, not changed). add_out: out += the product (the
    residual add; out is required); out_settled: no kernel of the last two launches before this one writes out
    (pdl.py's rule), so the regular kernel reads it before its PDL wait (ADD_EARLY) rather than after its loop."""
    paired = weight.get("paired", False)
    if silu_out and not paired:
        raise ValueError("int4 GEMV silu_out needs a pair_gate_up weight")
    if norm is not None and silu_mul:
        raise ValueError("int4 GEMV takes norm or silu_mul, not both")
    if add_out and (out is None or silu_out):
        raise ValueError("int4 GEMV add_out needs out (the residual stream) and no silu_out")
    if norm is not None and (norm[0].shape != (weight["k"],) or norm[0].dtype != x.dtype):
        raise ValueError(f"int4 GEMV norm weight: expected [{weight['k']}] {x.dtype}, got "
                         f"{tuple(norm[0].shape)} {norm[0].dtype}")
    n, k = weight["n"], weight["k"]
    if silu_out:
        config = config or int4_config(n, k, x.shape[0], weight.get("half2", False))
        if config.get("SPLIT_K", 1) > 1 or config["BLOCK_N"] % 2 or n % config["BLOCK_N"]:
            from dflash2.kernels.triton.elementwise import silu_and_mul

            return silu_and_mul(int4_gemv(x, weight, config=config, norm=norm))
        if out is None:
            out = torch.empty((x.shape[0], n // 2), dtype=x.dtype, device=x.device)
    x, out = prepare_io(x, weight, out, silu_mul)
    norm_weight, eps = norm if norm is not None else (x, 0.0)  # x: any pointer, never read without NORM
    m = out.shape[0]
    if m == 0:
        return out
    config = config or int4_config(n, k, m, weight.get("half2", False))
    if not _INTERPRETED and config["CHUNKS"] != CHUNK * config["num_warps"]:
        # otherwise warps share chunks and split the rows, and the activations (one row for all n) cannot
        # follow the weights' layout: Triton moves data through shared memory in the K loop
        raise ValueError(f"int4 GEMV config needs CHUNKS = 32 num_warps, got {config}")
    if x.shape[0] * x.stride(0) >= 1 << 31:
        raise ValueError("int4 GEMV indexes with int32 offsets: the activation is too large")
    tiles = triton.cdiv(n, config["BLOCK_N"])
    pdl = pdl_args()
    constants = launch_constants(weight, m, config, silu_mul=silu_mul, silu_out=silu_out, norm=norm is not None,
                                 add_out=add_out, out_settled=out_settled, asm=not _INTERPRETED)
    strides = (x.stride(0), weight["words"].stride(0), weight["sz"].stride(0), out.stride(0))
    if config.get("PERSISTENT"):
        programs = min(tiles, config.get("PROGRAMS") or config["PERSISTENT"] * multiprocessors(x.device))
        _int4_gemv_persistent_kernel[(programs,)](x, weight["words"], weight["sz"], out, m, n, k, *strides,
                                                  norm_weight, eps, **constants, **pdl)
        return out
    split_k = constants["SPLIT_K"]
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, tiles) if split_k > 1 else out
    _int4_gemv_kernel[(tiles, split_k)](x, weight["words"], weight["sz"], out, ws, counters, m, n, k, *strides,
                                        norm_weight, eps, **constants, **pdl)
    return out


def launch_constants(weight: dict, m: int, config: dict, *, silu_mul: bool = False, silu_out: bool = False,
                     norm: bool = False, add_out: bool = False, out_settled: bool = False,
                     asm: bool = True) -> dict:
    """The constexpr arguments and launch options (num_warps, num_stages, maxnreg) int4_gemv passes its kernel
    for m activation rows at `config`: the persistent kernel's where config has PERSISTENT, else the regular
    one's. Only the weight's scalars are read (n, k, group_size and the layout flags), so benchmarks/
    sass_count.py compiles the kernels with the very constants a launch uses."""
    n, k, block_n = weight["n"], weight["k"], config["BLOCK_N"]
    block_m = triton.next_power_of_2(m)
    step = config["CHUNKS"] * CHUNK
    common = {"GS": weight["group_size"], "BLOCK_M": block_m, "BLOCK_N": block_n, "CHUNKS": config["CHUNKS"],
              "SILU_MUL": silu_mul, "EVEN_M": m == block_m, "ASM": asm, "PAIRED": weight.get("paired", False),
              "SILU_OUT": silu_out, "HALF2": weight.get("half2", False), "NORM": norm, "ADD_OUT": add_out,
              "num_warps": config["num_warps"], "num_stages": config["num_stages"],
              **({"maxnreg": config["maxnreg"]} if "maxnreg" in config else {})}
    if config.get("PERSISTENT"):
        return {**common, "STEPS": triton.cdiv(k, step), "EVEN_K": k % step == 0}
    split_k = max(1, min(config.get("SPLIT_K", 1), triton.cdiv(k, step)))
    return {**common, "SPLIT_K": split_k, "EVEN_N": n % block_n == 0, "EVEN_K": k % (step * split_k) == 0,
            "PREFETCH": k > step * split_k, "ONE_STEP": norm and split_k == 1 and k <= step,
            "ADD_EARLY": add_out and out_settled and split_k == 1}
