"""Skinny GEMM for 16-bit weights: y = x @ W^T for a few activation rows (2-16: a decode step of a small batch),
where cuBLAS reads the weights at ~1.3 TB/s and launches without programmatic dependent launch.

A program owns BLOCK_N rows of W and one of SPLIT_K slices of K; it walks its slice in BLOCK_K tiles, pipelined
over num_stages (Triton's software pipelining: the tiles' loads are in flight while earlier ones are multiplied),
and multiplies each [BLOCK_N, BLOCK_K] tile with the activations' [16, BLOCK_K] on the tensor cores (tl.dot,
float32 accumulation). The activations are a few KiB, read by every program from L2; the weights stream once.
SPLIT_K > 1 parks float32 partials and lets the last program of a tile sum them (gemv_parts._store_or_reduce).
`silu_out=True` takes a fused [gate | up] weight (gate_up_proj's) and stores silu(gate) * up, rounded as the
GEMM followed by silu_and_mul would round it, so that kernel's launch goes.

Which calls come here: layers/linear.py's float_matmul (and Linear's silu_out), for 2 to `SKINNY_MAX_ROWS` rows of
a shape that has a config (`skinny_config`: SKINNY_SHAPE_CONFIGS, the shapes where a tune beat cuBLAS, or a tune's
table from DFLASH2_SKINNY_CONFIGS, benchmarks/small_m_tune.py --configs-out); every other shape runs cuBLAS.
SiLU-mul on the activations' loads (down_proj's input) measured slower than silu_and_mul + cuBLAS (10.16 against
8.39 us, twentieth session) and is gone (the code is at commit 3d5f0f3).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.elementwise import _silu_mul
from dflash2.kernels.triton.gemv_parts import (_block_indices, _k_range, _store_or_reduce, multiprocessors,
                                               prepare_io, shape_configs, split_counters)
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

BLOCK_M = 16  # tl.dot's smallest M; rows past M are masked
# (N, K) -> config: the shapes where the tune beat cuBLAS; every other shape stays on cuBLAS (skinny_config None).
# benchmarks/small_m_tune.py at 16 rows on the H200 (twentieth session, results/s20/call1_small_m_tune.json, us
# against cuBLAS): Qwen3-0.6B's qkv 4.48 / 5.24, o_proj 4.59 / 5.84, gate_up 5.39 / 5.88. The tied lm_head (151,936
# rows) at DEFAULT_CONFIG took ~157 against 75 us in the step's profile: it stays on cuBLAS, as does down.
SKINNY_SHAPE_CONFIGS: dict[tuple[int, int], dict] = {
    (4096, 1024): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 1},
    (1024, 2048): {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 4},
    (6144, 1024): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 1},
}
DEFAULT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}  # a call without a config
# the split along K, where a config does not give one: enough programs for about this many per SM
PROGRAMS_PER_SM = 2


def skinny_config(n: int, k: int) -> dict | None:
    """The config for this shape: a tune's table (DFLASH2_SKINNY_CONFIGS, {"NxK": config}), else
    SKINNY_SHAPE_CONFIGS; None where neither has the shape (those calls stay on cuBLAS)."""
    return shape_configs("DFLASH2_SKINNY_CONFIGS").get((n, k)) or SKINNY_SHAPE_CONFIGS.get((n, k))


def skinny_split_k(n: int, k: int, config: dict, sms: int) -> int:
    """config's SPLIT_K, else the split that gives about PROGRAMS_PER_SM programs an SM (at least two K tiles
    a slice)."""
    k_tiles = triton.cdiv(k, config["BLOCK_K"])
    if "SPLIT_K" in config:
        return max(1, min(config["SPLIT_K"], k_tiles))
    tiles = triton.cdiv(n, config["BLOCK_N"])
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, tiles), k_tiles // 2))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        SILU_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[m, n] = sum_k x[m, k] W[n, k] for n < N; SILU_OUT (SPLIT_K = 1): W is [gate | up] (2N rows) and the
    program multiplies its N rows of each half, storing silu(gate) * up rounded as silu_and_mul rounds the
    stored products."""
    pdl_start(USE_PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows, n_ok, rows64 = _block_indices(pid_n * BLOCK_N, N, BLOCK_N)
    m_idx, m_ok, m64 = _block_indices(0, M, BLOCK_M)
    k_start, k_end = _k_range(K, pid_k, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = acc  # (SILU_OUT only)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_ok = cols < k_end
        w_mask = n_ok[:, None] & k_ok[None, :]
        w_ptrs = w_ptr + rows64[:, None] * stride_wn + cols[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        a = tl.load(x_ptr + m64[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if SILU_OUT:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
    if SILU_OUT:
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + m_idx[:, None] * stride_om + rows[None, :], _silu_mul(acc.to(dtype), acc_up.to(dtype)),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, m_idx, rows, M, N, stride_om, pid_n, pid_k, SPLIT_K)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None,
                silu_out: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K]^T for a 16-bit weight of x's dtype, at `config` (else the shape's, else
    DEFAULT_CONFIG). silu_out: the weight is a fused [gate | up] projection, and the result silu(gate) * up,
    [M, N / 2] (at the whole weight's config with half its BLOCK_N, so a program reads as many rows, and no split
    along K)."""
    n, k = weight.shape
    if weight.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        raise ValueError(f"skinny GEMM takes a 16-bit weight of the activations' dtype, got {weight.dtype} "
                         f"and {x.dtype}")
    if silu_out and n % 2:
        raise ValueError(f"skinny GEMM silu_out takes a [gate | up] weight (an even row count), got {n} rows")
    config = config or skinny_config(n, k) or DEFAULT_CONFIG
    if silu_out:
        n //= 2
        config = {**config, "BLOCK_N": max(16, config["BLOCK_N"] // 2), "SPLIT_K": 1}
    x, out = prepare_io(x, {"n": n, "k": k}, out, False)
    m = x.shape[0]
    if m > BLOCK_M:
        raise ValueError(f"skinny GEMM takes at most {BLOCK_M} rows, got {m}")
    if m == 0:
        return out
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    tiles = triton.cdiv(n, config["BLOCK_N"])
    split_k = skinny_split_k(n, k, config, multiprocessors(x.device))
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, tiles) if split_k > 1 else out
    _skinny_gemm_kernel[(tiles, split_k)](x, weight, out, ws, counters, m, n, k, x.stride(0), weight.stride(0),
                                          out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=config["BLOCK_N"],
                                          BLOCK_K=config["BLOCK_K"], SPLIT_K=split_k, SILU_OUT=silu_out,
                                          num_warps=config["num_warps"], num_stages=config["num_stages"],
                                          **pdl_args())
    return out
