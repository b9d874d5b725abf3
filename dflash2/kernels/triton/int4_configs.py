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
# row tiles in _int4_gemv_persistent_kernel; SPLIT_K does not apply there.
INT4_GEMV_CONFIGS: dict = {
    1: {"BLOCK_N": 8, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
    2: {"BLOCK_N": 8, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
    4: {"BLOCK_N": 4, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1},
}
# (BLOCK_M, N, K) -> a config for one shape, over the above: the best of benchmarks/decode_gemv_tune.py on the
# H200 for the llama-3-8b shapes where it beat the default (results/decode_gemv_tune_int4_2026-11-29.json):
# o_proj 5.16 vs 5.75 us, gate_up 22.21 vs 23.9, lm_head 82.66 vs 85.5+ (qkv and down: the default)
_ONE_WARP = {"BLOCK_N": 8, "CHUNKS": 32, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1}
_SIXTEEN_ROWS = {"BLOCK_N": 16, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1}
INT4_GEMV_SHAPE_CONFIGS: dict = {
    (1, 4096, 4096): _SIXTEEN_ROWS,
    (1, 28672, 4096): _ONE_WARP,
    (1, 128256, 4096): _ONE_WARP,
}
# The half2 kernel with early loads, M = 1: 16 rows a program by default (decode_gemv_tune.py,
# results/s11/call3_tune_half2_early.json: best on every layer shape then). Per shape, the fourteenth session's
# tune with the persistent kernel (results/s14/call1_tune.log, us, against the 16-row default): gate_up as the
# engine runs it (silu_out) 19.13 at 8 rows, 4 programs an SM, against 20.94; lm_head 66.57 at 8 rows, 5 an SM,
# against 73.31 (the one-warp config before); qkv 6.03 and o_proj 4.18 capped at 168 registers, against 6.21 and
# 4.32. W2 int4 with these and the prefill GEMM table below: 527.4 / 528.5 tok/s against 497.5 (calls 1-2).
_CAPPED = {**_SIXTEEN_ROWS, "maxnreg": 168}
_PERSISTENT = {"BLOCK_N": 8, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1}
_TWO_WARPS = {"BLOCK_N": 8, "CHUNKS": 64, "num_warps": 2, "num_stages": 1, "SPLIT_K": 1}
_FOUR_ROWS_EIGHT = {"BLOCK_N": 4, "CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1, "PERSISTENT": 8}
# Per BLOCK_M with half2 products. M = 2 and 4 (a prefill graph's logit rows, small decode batches): the
# twenty-eighth session's tune (decode_gemv_tune.py --rows 2|4 --int4-only, results/s28/call3_tune_m*.log, us for
# qkv / o_proj / gate_up / down / lm_head). M = 4: the persistent kernel at 8 rows, 2 programs an SM, 11.13 / 8.52 /
# 39.97 / 29.44 / 162.15 against INT4_GEMV_CONFIGS[4]'s 22.33 / 15.14 / 98.84 / 39.79 / 430.89 (W2's prefill graph
# computes 4 logit rows: its lm_head took 443.6 us of the 8.27 ms first token, results/s28/call2_prefill_int4.json).
# M = 2: 5 programs an SM, 8.85 / 7.51 / 28.62 / 17.77 / 112.31 against 9.04 / 6.66 / 35.01 / 18.22 / 150.39.
INT4_HALF2_CONFIGS: dict = {1: _SIXTEEN_ROWS, 2: {**_PERSISTENT, "PERSISTENT": 5}, 4: {**_PERSISTENT, "PERSISTENT": 2}}
# per (BLOCK_M, N, K) where the tunes found better than the above (M = 2 and 4: the twenty-eighth session's)
INT4_HALF2_SHAPE_CONFIGS: dict = {
    (1, 6144, 4096): _CAPPED,
    (1, 4096, 4096): _CAPPED,
    (1, 28672, 4096): {**_PERSISTENT, "PERSISTENT": 4},
    (1, 128256, 4096): {**_PERSISTENT, "PERSISTENT": 5},
    (2, 4096, 4096): {**_TWO_WARPS, "PERSISTENT": 8},  # 5.84 us
    (2, 28672, 4096): _FOUR_ROWS_EIGHT,  # 27.27
    (2, 4096, 14336): {**_TWO_WARPS, "PERSISTENT": 8},  # 15.44
    (2, 128256, 4096): _FOUR_ROWS_EIGHT,  # 96.93
    (4, 4096, 14336): _TWO_WARPS,  # 26.61
    (4, 128256, 4096): _FOUR_ROWS_EIGHT,  # 159.35
}


def int4_config(n: int, k: int, m: int = 1, half2: bool = False) -> dict:
    block_m = triton.next_power_of_2(max(1, m))
    tuned = shape_configs("DFLASH2_INT4_CONFIGS")  # a tune's winners (decode_gemv_tune.py --configs-out), M = 1
    if block_m == 1 and (n, k) in tuned:
        return tuned[(n, k)]
    if half2:
        block_m = min(block_m, 4)
        return INT4_HALF2_SHAPE_CONFIGS.get((block_m, n, k), INT4_HALF2_CONFIGS[block_m])
    return INT4_GEMV_SHAPE_CONFIGS.get((block_m, n, k), INT4_GEMV_CONFIGS[min(block_m, 4)])
