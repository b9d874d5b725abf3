"""Triton quantized matmul ("triton", the CUDA default): kernels that read the packed weights as stored.

    rows M <= GEMV_MAX_M (decode)   _gemv_kernel: streams the weight once; BLOCK_N rows a program, K in tiles,
                                    optionally split along K (SPLIT_K programs per row block; the last one to
                                    finish sums the fp32 partials, so it stays one launch)
    more rows (prefill)             _gemm_kernel: tiles dequantized in registers, tl.dot, fp32 accumulation
    int4                            int4_gemv.py (decode, on a repacked copy of the weight) and int4_gemm.py
                                    (prefill: the dequantized tile as wgmma's register operand)
    16-bit weights                  the GEMV kernel for one row (`gemv_16bit`; layers/linear.float_matmul picks)

A weight tile is [BLOCK_N, T, GS]: T groups of GS weights along K (int6: GS = group size; int8 and 16: one
"group" of BLOCK_K). Codes become floats by the exponent trick (int | 0x4B000000 is 2^23 + int as a float)
instead of int->float conversions, which run at a quarter of the FMA rate. int6 folds the zero point out of
the inner loop:  sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k).

    int8   qweight [N, K] i8 as on disk, the per-row scale applied once at the end
    int6   repacked at prepare() into a 4-bit plane ([N, K/2], int4's layout) and a 2-bit plane ([N, K/4],
           4 codes a byte, lowest bits first): the 3-byte words cannot be loaded as vectors. Both planes are
           6 bits a weight; the on-disk tensors stay in the layer as well.

`silu_mul=True`: the input row is [gate | up] (width 2K) and the kernels multiply silu(gate) * up, rounded
to the activation dtype as the unfused silu_and_mul would. Everything is CUDA-graph safe: no host syncs,
outputs and split-K partials from torch.empty, and the split-K counters reset themselves.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight
from dflash2.kernels.triton.gemv_parts import (_activation, _block_indices, _k_range, _normed, _store_or_reduce,
                                                prepare_io, shape_configs, split_counters)
from dflash2.kernels.triton.int4_gemm import int4_gemm
from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up, prepare_int4
from dflash2.kernels.triton.pdl import pdl_args, pdl_start
from dflash2.quantization.formats import WeightFormat, unpack_int6

GEMV_MAX_M = 4  # more rows than this run the tl.dot kernel (16-bit: cuBLAS)
# M <= GEMV_MAX_M, per bit width; benchmarks/gemv_bench.py sweeps these on the GPU and prints the best.
# BLOCK_K is in weights (int6: rounded to whole groups). (bits, N, K) keys override for one shape.
GEMV_CONFIGS: dict[Any, dict[str, int]] = {
    16: {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
    8: {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2, "WORDS": 1},
    6: {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
    # qwen3-30b-a3b's qkv and o_proj (gemv_bench.py --shapes qwen3-30b-a3b --sweep-bits 16, one H100, 2026-12-07):
    # 9.20 -> 8.62 us and 8.33 -> 7.32 us a call against the 16-bit default above
    (16, 5120, 2048): {"BLOCK_N": 4, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1},
    (16, 2048, 4096): {"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 8, "num_stages": 1},
}
# WORDS: read int8 codes as int32 words (4 a word) rather than bytes; either works for any shape
GEMM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2, "WORDS": 1}
GEMM_SMALL_M_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3,
                       "WORDS": 1}
GEMM_SMALL_M = 32  # up to this many rows the GEMM takes GEMM_SMALL_M_CONFIG (split along K for occupancy)

# A GEMM with silu_mul loads a gate and an up tile of activations a stage: a config of BLOCK_K 256 at 4 stages
# then needs 253,952 bytes of shared memory against the H200's 232,448 (and 180,224 at 3 stages)
SILU_MUL_MAX_STAGES = 3
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# int4 decode (M <= GEMV_MAX_M) through kernels/triton/int4_gemv.py: a second, repacked copy of each weight,
# ~2.2-2.5 (16-bit models: packed fp16 products) to ~3.2 (float32 models: float32 products) sm_90 instructions a
# weight against ~8.6 for _gemv_kernel (benchmarks/sass_count.py), no shared memory in its K loop.


def gemv_config(bits: int, n: int, k: int) -> dict[str, int]:
    return GEMV_CONFIGS.get((bits, n, k), GEMV_CONFIGS[bits])


def gemm_config(bits: int, n: int, k: int, m: int) -> dict[str, int]:
    """GEMM_SMALL_M_CONFIG up to GEMM_SMALL_M rows; above, a tune's config for the shape where
    DFLASH2_GEMM_CONFIGS names one (benchmarks/prefill_gemm_tune.py --kernel gemm --configs-out), else
    GEMM_CONFIG."""
    if m <= GEMM_SMALL_M:
        return GEMM_SMALL_M_CONFIG
    return shape_configs("DFLASH2_GEMM_CONFIGS").get((bits, n, k)) or GEMM_CONFIG


# -- device helpers --------------------------------------------------------------------------------------
@triton.jit
def _as_float(v):
    """Integers 0 <= v < 2^23 (any int type) -> exact float32, without an int->float conversion."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _fields(w, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """int32 words -> [..., 4] fields of SHIFT bits at bits 0, SHIFT, 2 SHIFT, 3 SHIFT (low first)."""
    f0, f1 = w & MASK, (w >> SHIFT) & MASK
    f2, f3 = (w >> (2 * SHIFT)) & MASK, (w >> (3 * SHIFT)) & MASK
    return tl.join(tl.join(f0, f2), tl.join(f1, f3)).reshape(w.shape[0], w.shape[1], w.shape[2] * 4)


@triton.jit
def _codes(w_ptr, hi_ptr, rows, stride_wn, stride_hn, k0, k_end, n_mask, BITS: tl.constexpr, T: tl.constexpr,
           GS: tl.constexpr, WORDS: tl.constexpr):
    """The weight tile starting at column k0 as float32 [BLOCK_N, T, GS] (codes for 6 bits, else values).
    WORDS: the packed int8 weight is read as int32 words (4 codes each). One if/else chain with a single return:
    Triton compiles the statements after a return inside a constexpr branch as well."""
    t = tl.arange(0, T)[None, :, None]
    base = w_ptr + rows[:, None, None] * stride_wn
    if BITS == 8 and WORDS:
        mask = n_mask[:, None, None] & (k0 + t * GS < k_end)  # K is whole tiles when words are read
        w = tl.load(base + (k0 + t * GS) // 4 + tl.arange(0, GS // 4)[None, None, :], mask=mask, other=0)
        biased = _fields(w ^ -2139062144, 8, 255)  # ^ 0x80808080: every byte becomes q + 128
        result = (biased | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    elif BITS == 16:
        cols = k0 + t * GS + tl.arange(0, GS)[None, None, :]
        result = tl.load(base + cols, mask=n_mask[:, None, None] & (cols < k_end), other=0).to(tl.float32)
    elif BITS == 8:
        cols = k0 + t * GS + tl.arange(0, GS)[None, None, :]
        w = tl.load(base + cols, mask=n_mask[:, None, None] & (cols < k_end), other=0)
        result = (w.to(tl.int32) + (0x4B000000 + 128)).to(tl.float32, bitcast=True) - 8388736.0
    else:  # int6: the 4-bit plane (byte j: codes 2j low, 2j + 1 high) and the 2-bit plane
        mask = n_mask[:, None, None] & (k0 + t * GS < k_end)
        b = tl.load(base + (k0 + t * GS) // 2 + tl.arange(0, GS // 2)[None, None, :], mask=mask, other=0)
        q = tl.join(b & 15, b >> 4).reshape(b.shape[0], T, GS)
        hi_base = hi_ptr + rows[:, None, None] * stride_hn + (k0 + t * GS) // 4
        c = tl.load(hi_base + tl.arange(0, GS // 4)[None, None, :], mask=mask, other=0)
        high = tl.join(tl.join(c & 3, (c >> 4) & 3), tl.join((c >> 2) & 3, c >> 6)).reshape(b.shape[0], T, GS)
        result = _as_float(q | (high << 4))
    return result


# -- kernels ---------------------------------------------------------------------------------------------
@triton.jit
def _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M: tl.constexpr, STEP: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each of the BLOCK_M activation rows [BLOCK_M] (rms_norm's), in a pass over K."""
    m_idx = tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, STEP):
        cols = k0 + tl.arange(0, STEP)
        for m in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + m * stride_xm + cols, mask=(cols < K) & (m < M), other=0.0).to(tl.float32)
            total = tl.where(m_idx == m, total + tl.sum(x * x, axis=0), total)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, hi_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 stride_xm, stride_wn, stride_hn, stride_sn, stride_om, nw_ptr, eps,
                 BITS: tl.constexpr, GS: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, WORDS: tl.constexpr,
                 USE_PDL: tl.constexpr, NORM: tl.constexpr = False, ADD_OUT: tl.constexpr = False):
    """NORM: x is the residual stream and the input is its RMSNorm with weight nw (rms_norm's arithmetic: (x
    rstd) rounded to x's dtype, times the weight, rounded), rstd from a pass over the row before the K loop.
    ADD_OUT: out += the product (the residual add, _store_or_reduce's)."""
    pdl_start(USE_PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    out_rows, n_mask, rows = _block_indices(pid_n * BLOCK_N, N, BLOCK_N)
    m_idx = tl.arange(0, BLOCK_M)
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        rstd = _row_rstd(x_ptr, stride_xm, M, K, eps, BLOCK_M, T * GS)
    grouped: tl.constexpr = BITS == 6
    defer: tl.constexpr = BLOCK_M == 1 and not grouped  # one row, no groups: reduce over K once, at the end
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    wide = tl.zeros([BLOCK_N, T, GS], tl.float32)
    t = tl.arange(0, T)[:, None]
    for k0 in range(k_start, k_end, T * GS):
        cols = k0 + t * GS + tl.arange(0, GS)[None, :]  # [T, GS]
        k_mask = cols < k_end
        w = _codes(w_ptr, hi_ptr, rows, stride_wn, stride_hn, k0, k_end, n_mask, BITS, T, GS, WORDS)
        if grouped:
            s_offs = rows[:, None] * stride_sn + k0 // GS + t.reshape(1, T)
            g_mask = n_mask[:, None] & (k0 + t.reshape(1, T) * GS < k_end)
            scale = tl.load(s_ptr + s_offs, mask=g_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + s_offs, mask=g_mask, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x = _activation(x_ptr, m, stride_xm, K, cols, k_mask & (m < M), SILU_MUL)
            if NORM:
                row_rstd = tl.sum(tl.where(m_idx == m, rstd, 0.0), axis=0)
                nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
                x = _normed(x, row_rstd, nw, x_ptr.dtype.element_ty)
            if defer:
                wide += w * x[None]
            else:
                dots = tl.sum(w * x[None], axis=2)  # [BLOCK_N, T]
                if grouped:
                    dots = scale * (dots - zero * tl.sum(x, axis=1)[None, :])
                acc = tl.where(m_idx[:, None] == m, acc + tl.sum(dots, axis=1)[None, :], acc)
    if defer:
        acc += tl.sum(tl.sum(wide, axis=2), axis=1)[None, :]
    if BITS == 8:
        acc *= tl.load(s_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, m_idx, out_rows, M, N, stride_om, pid_n, pid_k, SPLIT_K,
                     ADD_OUT)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, hi_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 stride_xm, stride_wn, stride_hn, stride_sn, stride_om,
                 BITS: tl.constexpr, GS: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, WORDS: tl.constexpr,
                 IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    m_idx, m_ok, m64 = _block_indices(pid_m * BLOCK_M, M, BLOCK_M)
    rows, n_mask, rows64 = _block_indices(pid_n * BLOCK_N, N, BLOCK_N)
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    grouped: tl.constexpr = BITS == 6
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    t = tl.arange(0, T)[:, None]
    for k0 in range(k_start, k_end, T * GS):
        w = _codes(w_ptr, hi_ptr, rows64, stride_wn, stride_hn, k0, k_end, n_mask, BITS, T, GS, WORDS)
        if grouped:
            s_offs = rows64[:, None] * stride_sn + k0 // GS + t.reshape(1, T)
            g_mask = n_mask[:, None] & (k0 + t.reshape(1, T) * GS < k_end)
            scale = tl.load(s_ptr + s_offs, mask=g_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + s_offs, mask=g_mask, other=0.0).to(tl.float32)
            w = (w - zero[:, :, None]) * scale[:, :, None]
        flat_cols = k0 + tl.arange(0, T * GS)
        a = _activation(x_ptr, m64[:, None], stride_xm, K, flat_cols[None, :],
                        m_ok[:, None] & (flat_cols < k_end)[None, :], SILU_MUL)
        b = tl.trans(w.reshape(BLOCK_N, T * GS))
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a.to(x_ptr.dtype.element_ty), b.to(x_ptr.dtype.element_ty))
    if BITS == 8:
        acc *= tl.load(s_ptr + rows64, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, m_idx, rows, M, N, stride_om, pid, pid_k, SPLIT_K)


# -- launchers -------------------------------------------------------------------------------------------
def _tile(bits: int, group_size: int | None, block_k: int) -> tuple[int, int]:
    """(GS, T) for a K tile of about block_k weights."""
    if bits == 6:
        return group_size, max(1, block_k // group_size)
    return block_k, 1


def _launch(kernel: Any, x: torch.Tensor, weight: dict[str, Any], out: torch.Tensor, grid_mn: int, config: dict,
            block_m: int, silu_mul: bool, **extra: Any) -> None:
    bits, n, k = weight["bits"], weight["n"], weight["k"]
    gs, t = _tile(bits, weight.get("group_size"), config["BLOCK_K"])
    words = bool(config.get("WORDS", 1)) and weight.get("words") is not None and k % (gs * t) == 0
    split_k = max(1, min(config["SPLIT_K"], triton.cdiv(k, gs * t)))
    w = weight["words"] if words else weight["w"]
    hi = weight.get("hi", w)
    scales, zeros = weight.get("scales", w), weight.get("zeros", w)
    m = x.shape[0]
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, grid_mn) if split_k > 1 else out
    kernel[(grid_mn, split_k)](
        x, w, hi, scales, zeros, out, ws, counters, m, n, k, x.stride(0), w.stride(0), hi.stride(0),
        scales.stride(0) if scales.dim() == 2 else 0, out.stride(0), BITS=bits, GS=gs, T=t, BLOCK_M=block_m,
        BLOCK_N=config["BLOCK_N"], SPLIT_K=split_k, SILU_MUL=silu_mul, WORDS=words, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **extra, **pdl_args())


def gemv(x: torch.Tensor, weight: dict[str, Any], out: torch.Tensor | None = None, silu_mul: bool = False,
         config: dict[str, int] | None = None, norm: tuple[torch.Tensor, float] | None = None,
         add_out: bool = False) -> torch.Tensor:
    """y = act(x) @ W^T for x [M, K] (M <= GEMV_MAX_M, or any M; the kernel is built for few rows). int4:
    int4_gemv on the weight's repacked copy (`config`: one of its configs). norm = (weight [K], eps): the input
    is RMSNorm(x) as rms_norm computes it (x, the residual stream, is not changed); add_out: out += the product
    (the residual add; out is required). norm not with silu_mul."""
    if weight["bits"] == 4:
        return int4_gemv(x, weight["int4"], out=out, silu_mul=silu_mul, config=config, norm=norm,
                         add_out=add_out)
    if norm is not None and silu_mul:
        raise ValueError("the GEMV takes norm or silu_mul, not both")
    if add_out and out is None:
        raise ValueError("the GEMV's add_out needs out (the residual stream)")
    if norm is not None and (norm[0].shape != (weight["k"],) or norm[0].dtype != x.dtype):
        raise ValueError(f"GEMV norm weight: expected [{weight['k']}] {x.dtype}, got {tuple(norm[0].shape)} "
                         f"{norm[0].dtype}")
    x, out = prepare_io(x, weight, out, silu_mul)
    m, n = out.shape
    if m == 0:
        return out
    config = config or gemv_config(weight["bits"], n, weight["k"])
    block_m = triton.next_power_of_2(m)
    norm_weight, eps = norm if norm is not None else (x, 0.0)  # x: any pointer, never read without NORM
    _launch(_gemv_kernel, x, weight, out, triton.cdiv(n, config["BLOCK_N"]), config, block_m, silu_mul,
            nw_ptr=norm_weight, eps=eps, NORM=norm is not None, ADD_OUT=add_out)
    return out


def gemm(x: torch.Tensor, weight: dict[str, Any], out: torch.Tensor | None = None, silu_mul: bool = False,
         config: dict[str, int] | None = None) -> torch.Tensor:
    """y = act(x) @ W^T with the weight dequantized tile by tile (tl.dot); for 16/8/6 bits. int4: int4_gemm
    (`config`: one of its configs; no silu_mul)."""
    if weight["bits"] == 4:
        if silu_mul:
            raise ValueError("the int4 GEMM takes no silu_mul input")
        return int4_gemm(x, weight, out, config)
    x, out = prepare_io(x, weight, out, silu_mul)
    m, n = out.shape
    if m == 0:
        return out
    config = dict(config or gemm_config(weight["bits"], n, weight["k"], m))
    if silu_mul:  # two activation tiles a stage: down's tuned 4 stages would need 248 KiB of shared memory
        config["num_stages"] = min(config["num_stages"], SILU_MUL_MAX_STAGES)
    block_m = config["BLOCK_M"]
    if triton.cdiv(m, block_m) > 4:
        config["SPLIT_K"] = 1  # enough tiles already
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, config["BLOCK_N"])
    ieee = x.dtype == torch.float32 or _INTERPRETED  # the interpreter's tl.dot gets bfloat16 wrong
    _launch(_gemm_kernel, x, weight, out, grid_mn, config, block_m, silu_mul, IEEE=ieee)
    return out


def gemv_16bit(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, silu_mul: bool = False,
               norm: tuple[torch.Tensor, float] | None = None, add_out: bool = False) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul) @ weight[N, K]^T for a 16-bit weight, by the GEMV kernel (norm,
    add_out: gemv's)."""
    return gemv(x, {"bits": 16, "n": weight.shape[0], "k": weight.shape[1], "w": weight}, out, silu_mul,
                norm=norm, add_out=add_out)


# -- the backend -----------------------------------------------------------------------------------------
def device_tensors(packed: PackedWeight, dtype: torch.dtype) -> dict[str, Any]:
    """The tensors the kernels read for one packed weight: the stored ones, int4/int8 also as an int32 view
    (`words`, no copy; None where the row is not whole words), int6 repacked into its two planes, int4 also
    repacked for int4_gemv (`int4`)."""
    fmt, tensors = packed.fmt, packed.tensors
    weight: dict[str, Any] = {"bits": fmt.bits, "n": packed.out_features, "k": packed.in_features,
                              "group_size": fmt.group_size, "words": None}
    if fmt.bits == 16:
        weight["w"] = tensors["weight"].to(dtype).contiguous()
    elif fmt.bits == 8:
        weight.update(w=tensors["qweight"].contiguous(), scales=tensors["scales"].contiguous())
    else:
        weight.update(scales=tensors["scales"].contiguous(), zeros=tensors["zeros"].contiguous())
        if fmt.bits == 4:
            weight["w"] = tensors["qweight"].contiguous()
        else:
            weight["w"], weight["hi"] = int6_planes(tensors["qweight"])
    if fmt.bits in (4, 8) and weight["w"].shape[1] % 4 == 0 and weight["w"].storage_offset() % 4 == 0:
        weight["words"] = weight["w"].view(torch.int32)
    if fmt.bits == 4:  # packed fp16 products for 16-bit activations; a float32 model keeps float32 products
        weight["int4"] = prepare_int4(weight["w"], weight["scales"], weight["zeros"], fmt.group_size,
                                      half2=dtype != torch.float32)
    return weight


def int6_planes(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-disk int6 [N, 3K/4] -> (low 4 bits [N, K/2] as int4 packs them, high 2 bits [N, K/4], 4 a byte)."""
    q = unpack_int6(qweight)
    low, high = q & 15, q >> 4
    low_plane = low[:, 0::2] | (low[:, 1::2] << 4)
    high_plane = high[:, 0::4] | (high[:, 1::4] << 2) | (high[:, 2::4] << 4) | (high[:, 3::4] << 6)
    return low_plane.contiguous(), high_plane.contiguous()


class TritonWeight:
    """A prepared weight: GEMV kernel for up to GEMV_MAX_M rows; GEMM kernel (16-bit: F.linear) for more."""

    def __init__(self, fmt: WeightFormat, weight: dict[str, Any]) -> None:
        self.fmt, self.weight = fmt, weight
        small = "Triton GEMV" + (" (int6 as 4+2-bit planes)" if fmt.bits == 6 else "")
        large = "F.linear" if fmt.bits == 16 else "Triton GEMM (dequantized tiles, tl.dot)"
        if fmt.bits == 4:
            small, large = "Triton int4 GEMV (repacked words)", "Triton int4 GEMM (register-operand wgmma)"
        self.kernel = f"{small} for <= {GEMV_MAX_M} rows, {large} above ({fmt.name})"
        # [gate | up] input: fused into the 16-bit GEMV, where spare instructions hide behind the bytes;
        # at 8 and 4 bits recomputing silu in every row block costs more than the separate kernel
        self.fuses_silu_mul = fmt.bits == 16
        self.fuses_silu_out = False

    def pair_gate_up(self) -> None:
        """This weight's rows are [gate | up]. The int4 GEMV's repacked rows are interleaved (int4_gemv.
        pair_gate_up), so that matmul(silu_out=True) applies silu(gate) * up as it stores the outputs: one
        launch a layer fewer than a separate silu_and_mul, and no recomputed silu in every program of the next
        GEMV (which is why the int4 GEMV does not fuse silu_mul on its input)."""
        if self.fmt.bits == 4:
            self.weight["int4"] = pair_gate_up(self.weight["int4"])
            self.fuses_silu_out = True

    def fuses_norm(self, rows: int) -> bool:
        """Whether matmul(norm=, add_to=) runs the RMSNorm and the residual add inside the GEMV for `rows`
        activation rows (the int4 GEMV, and the 16-bit one)."""
        return self.fmt.bits in (4, 16) and rows <= GEMV_MAX_M

    def matmul(self, x: torch.Tensor, silu_mul: bool = False, silu_out: bool = False,
               norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T; silu_mul: x is [gate | up] and silu(gate) * up goes in; silu_out (after pair_gate_up): the
        output is [gate | up] and silu(gate) * up comes out. Where fuses_norm: norm = (weight, eps) makes the
        input RMSNorm(x); add_to: the product is added into that tensor, which is returned (the decoder layer's
        residual stream, which neither of the two kernels launched before this one writes: the GEMV reads it
        before its PDL wait, int4_gemv's out_settled)."""
        if norm is not None or add_to is not None:
            if not self.fuses_norm(x.shape[0]) or (silu_out and not self.fuses_silu_out):
                raise ValueError(f"this weight does not fuse a norm or residual add ({self.kernel}, "
                                 f"{x.shape[0]} rows)")
            if silu_out:
                return int4_gemv(x, self.weight["int4"], silu_mul=silu_mul, silu_out=True, norm=norm)
            if self.fmt.bits == 16:
                return gemv(x, self.weight, out=add_to, silu_mul=silu_mul, norm=norm, add_out=add_to is not None)
            return int4_gemv(x, self.weight["int4"], out=add_to, silu_mul=silu_mul, norm=norm,
                             add_out=add_to is not None, out_settled=True)
        if silu_out:
            if x.shape[0] <= GEMV_MAX_M and self.fuses_silu_out:
                return int4_gemv(x, self.weight["int4"], silu_mul=silu_mul, silu_out=True)
            from dflash2.kernels.triton.elementwise import silu_and_mul

            return silu_and_mul(self.matmul(x, silu_mul))
        if x.shape[0] <= GEMV_MAX_M:
            return gemv(x, self.weight, silu_mul=silu_mul)
        if silu_mul and self.fmt.bits in (4, 16):  # their GEMMs take no [gate | up] input
            from dflash2.kernels.triton.elementwise import silu_and_mul

            x, silu_mul = silu_and_mul(x), False
        if self.fmt.bits == 16:
            return F.linear(x, self.weight["w"])
        return gemm(x, self.weight, silu_mul=silu_mul)


class TritonQuantMatmul:
    name = "triton"

    def prepare(self, weight: PackedWeight, dtype: torch.dtype) -> TritonWeight:
        tensors = device_tensors(weight, dtype)
        split_counters(tensors["w"].device, weight.out_features)  # now, not inside a graph capture
        return TritonWeight(weight.fmt, tensors)
