"""int4 prefill GEMM: y = x @ W^T for more rows than the decode GEMV takes, reading the on-disk packed codes.

quant_matmul's general `_gemm_kernel` dequantizes a [BLOCK_N, BLOCK_K] weight tile and makes it tl.dot's second
operand, which Hopper's wgmma reads from shared memory only: every tile goes through a store to shared memory and
a barrier, and each wgmma is waited for before the next tile is dequantized. At 128 rows (W2's prompt) it took
2.1x cuBLAS on bf16 weights of the same shapes (277 against 133 us a llama-3-8b layer, fourteenth session).

This kernel computes the transposed product, out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] @ x^T
[BLOCK_K, BLOCK_M]: the dequantized weight is the *first* operand, which wgmma takes from registers, and the
activations (loaded by cp.async, pipelined over num_stages) the second, from shared memory. Rows of x are the
MMA's N dimension, so any M from 16 up runs at the MMA's full height. (Triton still moves the dequantized tile
into the register fragments' layout through shared memory: LDS, STS and LDSM with barriers, ~1/4 of the loop.)

Codes to floats without shifting every nibble down. A word holds the 8 codes of 8 consecutive columns, code i
at bits 4i. Four shifts (<< 3, << 11, >> 5 and a rotate by 19) bring each code to bits 19..22 (even i) or 15..18
(odd i) of some word, and one LOP3 each makes
    even i:  (v & 0x00780000) | 1.0f   = 1 + q / 16
    odd i:   (v & 0x00078000) | 16.0f  = 16 + q / 16
(the int4 GEMV's slot trick, int4_math.py, on the on-disk layout); one FFMA each dequantizes:
    w = f * 16 s - (16 + z) s   (even),   f * 16 s - (256 + z) s   (odd)   = (q - z) s
The constants are exact to float32 rounding (|c| < 272 s), so w is (q - z) s to within a float32 ulp of s before
its bf16 rounding. That is ~3 instructions a weight (1.5 to place the code, an FFMA, half a bf16 pack) where
_gemm_kernel spends ~6 (mask, shift, convert, subtract, multiply). Compiled offline for sm_90 (as
benchmarks/sass_count.py compiles), the whole K loop is 6.4 instructions a weight at 128 x 128 tiles against 8.1
for _gemm_kernel's gate_up config.

Split along K (SPLIT_K; without one in the config, enough to fill the SMs with the programs each holds) for
shapes with few output tiles (down_proj: 4,096 rows), by gemv_parts' tickets.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import (INLINE_ASM, _block_indices, _k_range, _store_or_reduce, multiprocessors,
                                               prepare_io, shape_configs, split_counters)
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

# a config: BLOCK_N weight rows x BLOCK_M activation rows a program, BLOCK_K columns (whole groups) a step;
# optional SPLIT_K and maxnreg (a register cap, passed to the launch). The tune at 128 rows on the H200
# (benchmarks/prefill_gemm_tune.py, twenty-first session, results/s21/call1_tune.log; us, against the legacy
# kernel's tuned table and cuBLAS on bf16 weights): qkv 31.59 / 33.53 / 16.61, o_proj 23.37 / 28.19 / 13.96,
# gate_up 86.47 / 122.72 / 65.67, down 77.71 / 95.65 / 37.06. One warpgroup a program at 172 registers and 108 KiB
# of shared memory lets two programs share an SM; 128 x 128 tiles on 8 warps (one program an SM) took 37.3 /
# 28.6 / 100.5 / 84.4.
DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
# (N, K) -> config where the tune found better than DEFAULT_CONFIG: llama-3-8b's o_proj (23.19 against 24.99 us)
# and qkv without the split the SMs would get (27.48 against 31.27; call 2, results/s21/call2_tune.log). A tune's
# table from DFLASH2_INT4_GEMM_CONFIGS ({"NxK": config}, prefill_gemm_tune.py --configs-out) takes precedence
SHAPE_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (4096, 4096): {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    (6144, 4096): {**DEFAULT_CONFIG, "SPLIT_K": 1},
}


def int4_gemm_config(n: int, k: int, m: int) -> dict[str, int]:
    """A tune's config for (N, K), else SHAPE_CONFIGS's, else DEFAULT_CONFIG; BLOCK_M shrinks to the rows there
    are (at least 16: the MMA's smallest N)."""
    config = dict(shape_configs("DFLASH2_INT4_GEMM_CONFIGS").get((n, k)) or SHAPE_CONFIGS.get((n, k))
                  or DEFAULT_CONFIG)
    config["BLOCK_M"] = max(16, min(config.get("BLOCK_M", 128), triton.next_power_of_2(m)))
    return config


@triton.jit
def _code_floats(w, ASM: tl.constexpr):
    """int32 words (codes 0..7 at bits 4i) -> 8 float32 tensors: code i as 1 + q / 16 (even i) or 16 + q / 16
    (odd i), see the module docstring. ASM: the shifts and one LOP3 each in PTX (ptxas splits `(v & m) | c`
    into two instructions otherwise)."""
    if ASM:
        f0, f1, f2, f3, f4, f5, f6, f7 = tl.inline_asm_elementwise(
            """{
            .reg .b32 u0, u1, u2, u3;
            shl.b32 u0, $8, 3;
            shl.b32 u1, $8, 11;
            shr.u32 u2, $8, 5;
            shf.l.wrap.b32 u3, $8, $8, 19;
            lop3.b32 $0, u3, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $1, u1, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $2, u1, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $3, u0, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $4, u0, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $5, u2, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $6, u2, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $7, u3, 0x00078000, 0x41800000, 0xEA;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        u0 = w << 3
        u1 = w << 11
        u2 = (w >> 5) & 0x07FFFFFF
        u3 = (w << 19) | ((w >> 13) & 0x7FFFF)
        even_mask, even_one = 0x00780000, 0x3F800000
        odd_mask, odd_one = 0x00078000, 0x41800000
        f0, f1 = (u3 & even_mask) | even_one, (u1 & odd_mask) | odd_one
        f2, f3 = (u1 & even_mask) | even_one, (u0 & odd_mask) | odd_one
        f4, f5 = (u0 & even_mask) | even_one, (u2 & odd_mask) | odd_one
        f6, f7 = (u2 & even_mask) | even_one, (u3 & odd_mask) | odd_one
    return (f0.to(tl.float32, bitcast=True), f1.to(tl.float32, bitcast=True), f2.to(tl.float32, bitcast=True),
            f3.to(tl.float32, bitcast=True), f4.to(tl.float32, bitcast=True), f5.to(tl.float32, bitcast=True),
            f6.to(tl.float32, bitcast=True), f7.to(tl.float32, bitcast=True))


@triton.jit
def _dequantized_tile(w_ptr, s_ptr, z_ptr, rows64, stride_wn, stride_sn, k0, k_end, GS: tl.constexpr,
                      T: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """The weight tile [BLOCK_N, T * GS] from column k0 as float32 (groups past k_end are zeros; EVEN_K: there
    are none). Rows past N were clamped to row 0 (rows64): their loads need no mask."""
    t = tl.arange(0, T)
    g_ok = (k0 + t * GS < k_end)[None, :]  # [1, T]: loads broadcast it
    g_offs = rows64[:, None] * stride_sn + k0 // GS + t[None, :]
    if EVEN_K:
        s = tl.load(s_ptr + g_offs).to(tl.float32)
        z = tl.load(z_ptr + g_offs).to(tl.float32)
    else:
        s = tl.load(s_ptr + g_offs, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_offs, mask=g_ok, other=0.0).to(tl.float32)
    s16, c_even, c_odd = (16.0 * s)[:, :, None], (-(16.0 + z) * s)[:, :, None], (-(256.0 + z) * s)[:, :, None]
    j = tl.arange(0, GS // 8)
    word_ptrs = w_ptr + rows64[:, None, None] * stride_wn + (k0 // 8 + t[None, :, None] * (GS // 8) + j[None, None, :])
    if EVEN_K:
        words = tl.load(word_ptrs)  # [BLOCK_N, T, GS / 8]
    else:
        words = tl.load(word_ptrs, mask=g_ok[:, :, None], other=0)
    f0, f1, f2, f3, f4, f5, f6, f7 = _code_floats(words, ASM)
    v0, v1, v2, v3 = f0 * s16 + c_even, f1 * s16 + c_odd, f2 * s16 + c_even, f3 * s16 + c_odd
    v4, v5, v6, v7 = f4 * s16 + c_even, f5 * s16 + c_odd, f6 * s16 + c_even, f7 * s16 + c_odd
    # code i of word j -> column 8 j + i (each join adds a trailing axis: the outermost picks bit 0 of i)
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.join(even, odd).reshape(BLOCK_N, T * GS)


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_om,
                      GS: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """out[m, n] = sum_k x[m, k] W[n, k]; a program owns BLOCK_N weight rows x BLOCK_M activation rows (the
    activation row blocks of one weight block are neighbours in the grid, so they share its tiles in L2) and
    one of SPLIT_K slices of K."""
    pdl_start(USE_PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n, pid_m = pid // num_m, pid % num_m
    rows, _, rows64 = _block_indices(pid_n * BLOCK_N, N, BLOCK_N)
    m_idx, _, m64 = _block_indices(pid_m * BLOCK_M, M, BLOCK_M)
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, T * GS):
        w = _dequantized_tile(w_ptr, s_ptr, z_ptr, rows64, stride_wn, stride_sn, k0, k_end, GS, T, BLOCK_N,
                              EVEN_K, ASM)
        cols = k0 + tl.arange(0, T * GS)
        x_ptrs = x_ptr + m64[None, :] * stride_xm + cols[:, None]  # [T * GS, BLOCK_M]; rows past M clamped to 0
        if EVEN_K:
            xt = tl.load(x_ptrs)
        else:
            xt = tl.load(x_ptrs, mask=(cols < k_end)[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x_ptr.dtype.element_ty), xt, acc)
    _store_or_reduce(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, m_idx, rows, M, N, stride_om, pid, pid_k, SPLIT_K)


def int4_gemm(x: torch.Tensor, weight: dict[str, Any], out: torch.Tensor | None = None,
              config: dict[str, int] | None = None) -> torch.Tensor:
    """y = x @ W^T for an int4 weight as quant_matmul.device_tensors holds it (its int32 `words`)."""
    x, out = prepare_io(x, weight, out, False)
    m, n = out.shape
    if m == 0:
        return out
    k, gs, words = weight["k"], weight["group_size"], weight["words"]
    if words is None or gs % 8 or weight["scales"].dim() != 2:
        raise ValueError("int4 GEMM reads the codes as int32 words, with group-wise scales")
    config = config or int4_gemm_config(n, k, m)
    t = max(1, config["BLOCK_K"] // gs)
    block_m = config["BLOCK_M"]
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, config["BLOCK_N"])
    k_tiles = triton.cdiv(k, gs * t)
    # without one in the config: as many slices as fill the SMs with the programs an SM holds (two of one
    # warpgroup, as DEFAULT_CONFIG's; one of two), rounded down. down (4096 x 14336) at 128 rows: 4 slices, 61.81
    # us, against 76.67 at 3 (the ceiling of one program an SM, which leaves most SMs one program) and 71.5-97.4
    # at 1, 2, 5, 6, 8 (twenty-fourth session, call 1, results/s24/); W2 int4's first token 8.2 / 7.97 ms against
    # 8.68 / 8.62.
    per_sm = max(1, 8 // config["num_warps"])
    split_k = config.get("SPLIT_K") or max(1, per_sm * multiprocessors(x.device) // grid_mn)
    split_k = max(1, min(split_k, k_tiles // 4 if "SPLIT_K" not in config else k_tiles))  # >= 4 tiles a slice
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, grid_mn) if split_k > 1 else out
    scales = weight["scales"]
    ieee = x.dtype == torch.float32 or not INLINE_ASM  # the interpreter's tl.dot gets bfloat16 wrong
    _int4_gemm_kernel[(grid_mn, split_k)](
        x, words, scales, weight["zeros"], out, ws, counters, m, n, k, x.stride(0), words.stride(0),
        scales.stride(0), out.stride(0), GS=gs, T=t, BLOCK_N=config["BLOCK_N"], BLOCK_M=block_m, SPLIT_K=split_k,
        EVEN_K=k % (gs * t) == 0, IEEE=ieee, ASM=INLINE_ASM, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **({"maxnreg": config["maxnreg"]} if "maxnreg" in config else {}), **pdl_args())
    return out
