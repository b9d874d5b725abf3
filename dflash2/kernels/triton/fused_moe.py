"""The mixture-of-experts MLP in three launches (plus the alignment's one or two), on 16-bit or packed weights:

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, j]

    1. moe_align.align_by_expert   (token, slot) pairs sorted by expert into blocks of BLOCK_M rows
    2. _gate_up_kernel             per block: x's rows of its pairs @ the expert's gate and up rows, both tiles of
                                   BLOCK_N columns in one program, SiLU(gate) * up in the epilogue
                                   -> hidden [rows, I] in x's dtype, in the sorted order
    3. _down_kernel                per block: hidden @ the expert's down rows, times the pair's router weight,
                                   stored at the pair's row -> per_slot [T k, H]
    4. per_slot.view(T, k, H).sum(1)   the k slots of a token (no atomics: every pair has its own row)

A few pairs (decode; fused_moe_configs.py's SMALL) take fused_moe_small.py instead: no blocks, a program a pair and
a tile of columns, in two launches with the same rounding.

Weights (formats.py's layouts with a leading expert dimension, read packed; each tile is dequantized in
registers, never a whole expert):
    bits 16   w [E, N, K] in x's dtype
    bits 8    w [E, N, K] int8, scales [E, N] f16: w = q * scale, the scale applied to the accumulator
    bits 4    w [E, N, K/2] uint8 (byte j: q[2j] low nibble, q[2j+1] high), scales and zeros [E, N, K/G] f16:
              w = (q - zero) * scale per group of G along K
    bits 6    w [E, N, 3K/4] uint8 (4 codes in 3 bytes, little-endian, 6 bits each), scales and zeros as int4
gate_up is [E, 2I, H] (gate rows, then up), down [E, H, I].

Rounding follows the unfused model: gate and up rounded to x's dtype before silu_mul (elementwise._silu_mul),
the down product rounded to x's dtype before the router weight multiplies it in float32, rounded again, and the
k slots summed in float32 (torch's sum) and rounded once. Dequantized weights are rounded to x's dtype for the
MMA, as a dequantized copy of that dtype would be.

CUDA graphs: every launch shape depends only on T, k, E and the config; no host syncs; blocks past the used
ones (known on the device only) return at once.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.elementwise import _silu_mul
from dflash2.kernels.triton.fused_moe_configs import moe_config
from dflash2.kernels.triton.gemv_parts import _block_indices
from dflash2.kernels.triton.moe_align import align_by_expert
from dflash2.kernels.triton.pdl import pdl_args, pdl_start
from dflash2.quantization.formats import ALLOWED_GROUP_SIZES

BITS = (16, 8, 6, 4)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's tl.dot gets bfloat16 wrong


# -- device helpers --------------------------------------------------------------------------------------
@triton.jit
def _tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program -> (row block, column block): GROUP_M row blocks walk the column blocks together."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, rows64, k0, K, stride_wn, stride_sn, BITS: tl.constexpr, GROUP: tl.constexpr,
                 GS: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr):
    """One expert's weight rows `rows64` (clamped into range) at columns k0 .. k0 + T GS as float32 [BLOCK_N,
    T GS], zeros past K: 16 bits the values, 8 bits the codes (the row scale comes later), 4 and 6 bits
    (q - zero) * scale. A step is T pieces of GS columns (4/6 bits: GS divides the group G, or is it)."""
    starts = k0 + tl.arange(0, T)[None, :, None] * GS  # [1, T, 1]
    row_ptrs = w_ptr + rows64[:, None, None] * stride_wn
    if BITS == 16 or BITS == 8:
        cols = starts + tl.arange(0, GS)[None, None, :]
        w = tl.load(row_ptrs + cols, mask=cols < K, other=0).to(tl.float32)
    else:
        if BITS == 4:
            b = tl.load(row_ptrs + starts // 2 + tl.arange(0, GS // 2)[None, None, :], mask=starts < K, other=0)
            q = tl.join(b & 15, b >> 4).reshape(BLOCK_N, T, GS)
        else:
            byte_ptrs = row_ptrs + (starts // 4 + tl.arange(0, GS // 4)[None, None, :]) * 3
            b0 = tl.load(byte_ptrs, mask=starts < K, other=0).to(tl.int32)
            b1 = tl.load(byte_ptrs + 1, mask=starts < K, other=0).to(tl.int32)
            b2 = tl.load(byte_ptrs + 2, mask=starts < K, other=0).to(tl.int32)
            word = b0 | (b1 << 8) | (b2 << 16)
            q = tl.join(tl.join(word & 63, (word >> 12) & 63),
                        tl.join((word >> 6) & 63, (word >> 18) & 63)).reshape(BLOCK_N, T, GS)
        g_ptrs = rows64[:, None, None] * stride_sn + starts // GROUP
        scale = tl.load(s_ptr + g_ptrs, mask=starts < K, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g_ptrs, mask=starts < K, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - zero) * scale
    return w.reshape(BLOCK_N, T * GS)


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr):
    """acc + a [BLOCK_M, BK] @ w [BLOCK_N, BK]^T, w rounded to a's dtype first."""
    b = tl.trans(w.to(a.dtype))
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# -- kernels ---------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, hidden_ptr, pair_ids_ptr, block_experts_ptr, num_pairs, I, K,
                    num_blocks, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, T: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """hidden[row, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for the pair t * k + j on each row of a block
    (zeros on padding rows), e the block's expert, n in one block of BLOCK_N of I columns."""
    pdl_start(USE_PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)
    pair_ok = pairs < num_pairs
    tokens = tl.where(pair_ok, pairs // TOP_K, 0).to(tl.int64)
    cols, col_ok, cols64 = _block_indices(pid_n * BLOCK_N, I, BLOCK_N)
    w_ptr += expert.to(tl.int64) * stride_we
    s_ptr += expert.to(tl.int64) * stride_se
    z_ptr += expert.to(tl.int64) * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, T * GS):
        ks = k0 + tl.arange(0, T * GS)
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=pair_ok[:, None] & (ks < K)[None, :],
                    other=0.0)
        gate = _mma(a, _weight_tile(w_ptr, s_ptr, z_ptr, cols64, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T,
                                    BLOCK_N), gate, IEEE)
        up = _mma(a, _weight_tile(w_ptr, s_ptr, z_ptr, cols64 + I, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T,
                                  BLOCK_N), up, IEEE)
    if BITS == 8:  # the row scales
        gate *= tl.load(s_ptr + cols64 * stride_sn).to(tl.float32)[None, :]
        up *= tl.load(s_ptr + (cols64 + I) * stride_sn).to(tl.float32)[None, :]
    dtype = hidden_ptr.dtype.element_ty
    gate, up = gate.to(dtype), up.to(dtype)
    tl.store(hidden_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], _silu_mul(gate, up),
             mask=col_ok[None, :])


@triton.jit
def _down_kernel(hidden_ptr, w_ptr, s_ptr, z_ptr, out_ptr, pair_ids_ptr, block_experts_ptr, router_ptr, num_pairs,
                 N, K, num_blocks, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """out[p, n] = router[p] * (hidden[row] . down_e[n]) for the pair p on each row of a block (padding rows
    store nothing), n in one block of BLOCK_N of the N = H columns."""
    pdl_start(USE_PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pairs = tl.load(pair_ids_ptr + rows)
    pair_ok = pairs < num_pairs
    cols, col_ok, cols64 = _block_indices(pid_n * BLOCK_N, N, BLOCK_N)
    w_ptr += expert.to(tl.int64) * stride_we
    s_ptr += expert.to(tl.int64) * stride_se
    z_ptr += expert.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, T * GS):
        ks = k0 + tl.arange(0, T * GS)
        a = tl.load(hidden_ptr + rows[:, None] * stride_hm + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        acc = _mma(a, _weight_tile(w_ptr, s_ptr, z_ptr, cols64, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T,
                                   BLOCK_N), acc, IEEE)
    if BITS == 8:
        acc *= tl.load(s_ptr + cols64 * stride_sn).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    router = tl.load(router_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * router[:, None]
    out_rows = tl.where(pair_ok, pairs, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], y.to(dtype),
             mask=pair_ok[:, None] & col_ok[None, :])


# -- launcher --------------------------------------------------------------------------------------------
def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, bits: int = 16, group_size: int | None = None,
              gate_up_scales: torch.Tensor | None = None, gate_up_zeros: torch.Tensor | None = None,
              down_scales: torch.Tensor | None = None, down_zeros: torch.Tensor | None = None,
              config: dict | None = None, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' weighted sum for x [T, H] (bf16, fp16 or fp32) routed by topk_weights (float32 or x's dtype)
    and topk_ids [T, k] (int64 or int32, distinct experts per token), in x's dtype [T, H]. Weights and their
    scales/zeros as in the module docstring; group_size (4/6 bits) may be left to the scales' shape. config: see
    fused_moe_configs.py (missing keys from the table or the default for this shape). add_to (where takes_add_to,
    the few-pairs path): the sum is added into that [T, H] tensor (the residual stream) in the down kernel's
    store, and that tensor returned."""
    if bits not in BITS:
        raise ValueError(f"fused_moe supports bits {', '.join(map(str, BITS))}, got {bits}")
    num_tokens, hidden = _check_routing(x, topk_weights, topk_ids)
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    gate_up = _checked_weight("w_gate_up", x, bits, w_gate_up, gate_up_scales, gate_up_zeros, group_size,
                              num_experts, 2 * inter, hidden)
    down = _checked_weight("w_down", x, bits, w_down, down_scales, down_zeros, group_size, num_experts, hidden,
                           inter)
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x) if add_to is None else add_to
    gate_up_config, down_config = moe_config(num_experts, hidden, inter, bits, num_tokens, top_k, config)
    if add_to is not None and (not gate_up_config.get("SMALL") or add_to.shape != x.shape
                               or add_to.dtype != x.dtype or add_to.stride(1) != 1):
        raise ValueError(f"fused_moe add_to: a [T, H] tensor of x's dtype on the few-pairs path, got "
                         f"{tuple(add_to.shape)} {add_to.dtype} for {num_tokens} tokens")
    if gate_up_config.get("SMALL"):
        from dflash2.kernels.triton.fused_moe_small import fused_moe_small  # it imports this module's helpers

        return fused_moe_small(x, gate_up, down, topk_weights, topk_ids, bits, gate_up_config, down_config,
                               add_to)
    block_m = gate_up_config["BLOCK_M"]
    layout = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = layout.block_experts.numel()
    num_pairs = num_tokens * top_k
    ieee = x.dtype == torch.float32 or _INTERPRETED
    hidden_rows = torch.empty((layout.pair_ids.numel(), inter), dtype=x.dtype, device=x.device)
    w, scales, zeros, group = gate_up
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, gate_up_config["BLOCK_N"]),)](
        x, w, scales, zeros, hidden_rows, layout.pair_ids, layout.block_experts, num_pairs, inter, hidden,
        num_blocks, x.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), hidden_rows.stride(0),
        TOP_K=top_k, **_tile_args(bits, group, gate_up_config), IEEE=ieee, **_launch_args(gate_up_config))
    per_slot = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    w, scales, zeros, group = down
    router = topk_weights.reshape(-1)
    _down_kernel[(num_blocks * triton.cdiv(hidden, down_config["BLOCK_N"]),)](
        hidden_rows, w, scales, zeros, per_slot, layout.pair_ids, layout.block_experts, router, num_pairs, hidden,
        inter, num_blocks, hidden_rows.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1),
        per_slot.stride(0), **_tile_args(bits, group, down_config), IEEE=ieee, **_launch_args(down_config))
    if top_k == 1:
        return per_slot
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1)


def takes_add_to(num_experts: int, hidden: int, inter: int, bits: int, num_tokens: int, top_k: int) -> bool:
    """Whether fused_moe(add_to=) takes these tokens (the few-pairs path's configs)."""
    return bool(moe_config(num_experts, hidden, inter, bits, num_tokens, top_k)[0].get("SMALL"))


def pieces(bits: int, group: int, block_k: int) -> tuple[int, int]:
    """(GS, T): BLOCK_K as T pieces of GS columns; 4/6 bits, pieces no wider than a group (one scale each)."""
    gs = min(block_k, group) if bits in (4, 6) else block_k
    return gs, block_k // gs


def _tile_args(bits: int, group: int, config: dict) -> dict:
    gs, t = pieces(bits, group, config["BLOCK_K"])
    return {"BITS": bits, "GROUP": group, "GS": gs, "T": t, "BLOCK_M": config["BLOCK_M"],
            "BLOCK_N": config["BLOCK_N"], "GROUP_M": config["GROUP_M"]}


def _launch_args(config: dict) -> dict:
    return {"num_warps": config["num_warps"], "num_stages": config["num_stages"], **pdl_args()}


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [T, H] in bf16, fp16 or fp32, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, k] int32/int64 with T = {x.shape[0]}, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)} in float32 or x's dtype, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if not (topk_weights.is_contiguous() and topk_ids.is_contiguous()):
        raise ValueError("topk_weights and topk_ids must be contiguous")
    return x.shape[0], x.shape[1]


def _checked_weight(name: str, x: torch.Tensor, bits: int, w: torch.Tensor, scales: torch.Tensor | None,
                    zeros: torch.Tensor | None, group_size: int | None, num_experts: int, n: int, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(weight, scales, zeros, group size) as the kernels take them, after checking shapes and dtypes against
    formats.py's layouts; 16 bits: the weight stands in for the absent scales and zeros (never read)."""
    packed_k = {16: k, 8: k, 4: k // 2, 6: k * 3 // 4}[bits]
    dtype = {16: x.dtype, 8: torch.int8, 4: torch.uint8, 6: torch.uint8}[bits]
    if tuple(w.shape) != (num_experts, n, packed_k) or w.dtype != dtype or w.stride(2) != 1:
        raise ValueError(f"{name}: bits={bits} wants [{num_experts}, {n}, {packed_k}] {dtype} with contiguous "
                         f"rows, got {tuple(w.shape)} {w.dtype}")
    if bits == 16:
        return w, w, w, 1
    if bits == 8:
        _check_scales(name, "scales", scales, (num_experts, n))
        return w, scales, scales, 1
    if scales is None or zeros is None or scales.dim() != 3 or not scales.shape[-1]:
        raise ValueError(f"{name}: bits={bits} needs scales and zeros [{num_experts}, {n}, {k} / group size]")
    group = group_size or k // scales.shape[-1]
    if group not in ALLOWED_GROUP_SIZES or k % group:
        raise ValueError(f"{name}: group size {group} does not fit rows of {k} (one of {ALLOWED_GROUP_SIZES})")
    _check_scales(name, "scales", scales, (num_experts, n, k // group))
    _check_scales(name, "zeros", zeros, (num_experts, n, k // group))
    if zeros.stride() != scales.stride():  # the kernels index both with the scales' strides
        raise ValueError(f"{name}: zeros and scales must have the same strides")
    return w, scales, zeros, group


def _check_scales(name: str, what: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if t is None or tuple(t.shape) != shape or t.stride(-1) != 1:
        got = "none" if t is None else str(tuple(t.shape))
        raise ValueError(f"{name}: {what} must be {list(shape)} with contiguous rows, got {got}")
