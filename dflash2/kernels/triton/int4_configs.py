"""Kernel configs of the int4 decode GEMV (kernels: int4_gemv.py): the defaults per activation rows, the
per-shape picks of benchmarks/decode_gemv_tune.py on the H200, and a tune's table from DFLASH2_INT4_CONFIGS."""
from __future__ import annotations

import triton

from dflash2.kernels.triton.gemv_parts import shape_configs

# Per BLOCK_M (activation rows rounded up to a power of two). BLOCK_N rows a program; CHUNKS = 32 num_warps
# puts every thread on its own 32 columns of all BLOCK_N rows (a step of 32 CHUNKS columns along K); fewer
# CHUNKS spread the rows over warps as well. More rows a thread share the activation work but take registers
# (sm_90, M = 1, float32 products: BLOCK_N 8 / 16 -> 128 / 254 registers; half2: 96 / 168). A config may also
# cap the registers a thread ("maxnreg", passed to the launch): ptxas spills past the cap, and more programs fit
# an SM. "PERSISTENT": P programs an SM (the grid is P times the SMs, or the tiles if fewer), each walking its
# row tiles in _int4_gemv_persistent_kernel; SPLIT_K and PREFETCH do not apply there.
INT4_GEMV_CONFIGS: dict = {
    1: {"BLOCK_N": 8, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
    2: {"BLOCK_N": 8, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
    4: {"BLOCK_N": 4, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
}
# (BLOCK_M, N, K) -> a config for one shape, over the above: the best of benchmarks/decode_gemv_tune.py on the
# H200 for the llama-3-8b shapes where it beat the default (results/decode_gemv_tune_int4_2026-11-29.json):
# o_proj 5.16 vs 5.75 us, gate_up 22.21 vs 23.9, lm_head 82.66 vs 85.5+ (qkv and down: the default)
_ONE_WARP = {"BLOCK_N": 8, "CHUNKS": 32, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1, "PREFETCH": 1}
_SIXTEEN_ROWS = {"BLOCK_N": 16, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1}
INT4_GEMV_SHAPE_CONFIGS: dict = {
    (1, 4096, 4096): _SIXTEEN_ROWS,
    (1, 28672, 4096): _ONE_WARP,
    (1, 128256, 4096): _ONE_WARP,
}
# The half2 kernel with early loads, M = 1 (decode_gemv_tune.py, results/s11/call3_tune_half2_early.json, us):
# 16 rows a program is best on every layer shape (qkv 6.19, o_proj 4.23, gate_up 20.35, down 10.55; the half2
# tune without early loads had picked one-warp and 8-row configs, at 6.15 / 5.33 / 20.88 / 12.28), and one warp
# of 16 rows on lm_head (73.31 against 76.24 at _ONE_WARP)
INT4_HALF2_M1_CONFIG = _SIXTEEN_ROWS
INT4_HALF2_SHAPE_CONFIGS: dict = {
    (1, 128256, 4096): {**_ONE_WARP, "BLOCK_N": 16},
}


def int4_config(n: int, k: int, m: int = 1, half2: bool = False) -> dict:
    block_m = triton.next_power_of_2(max(1, m))
    tuned = shape_configs("DFLASH2_INT4_CONFIGS")  # a tune's winners (decode_gemv_tune.py --configs-out), M = 1
    if block_m == 1 and (n, k) in tuned:
        return tuned[(n, k)]
    if half2:
        default = INT4_HALF2_M1_CONFIG if block_m == 1 else INT4_GEMV_CONFIGS[min(block_m, 4)]
        return INT4_HALF2_SHAPE_CONFIGS.get((block_m, n, k), default)
    return INT4_GEMV_SHAPE_CONFIGS.get((block_m, n, k), INT4_GEMV_CONFIGS[min(block_m, 4)])
