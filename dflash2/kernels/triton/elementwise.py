"""Fused elementwise kernels for the GPU decode path: fewer, larger launches than the torch ops they replace.

    add_rms_norm   residual += x; out = rmsnorm(residual) * w     (one pass instead of five kernels)
    rms_norm       out = rmsnorm(x) * w
    qk_rms_norm_   Qwen3's per-head q and k norms, in place on the strided views of the qkv output (one launch
                   instead of two copies and two norms)
    rotary         q, k rotated in place (rotate-half layout), cos/sin read from the cached table
    silu_and_mul   out = silu(gate) * up, reading the fused gate_up projection once
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.pdl import pdl_args, pdl_start


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / n_cols
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, w * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of a 2-D x; with `residual`, first residual += x (in place) and norm that."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                              num_warps=4 if cols <= 2048 else 8, **pdl_args())
    return out


@triton.jit
def _head_rms_norm(base, weight_ptr, t, stride_t, stride_h, num_heads, eps, HEAD_DIM: tl.constexpr,
                   HEADS_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_heads)[:, None]
    offs = t * stride_t + h[:, None] * stride_h + d[None, :]
    x = tl.load(base + offs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 1) / HEAD_DIM
    normed = (x32 * tl.rsqrt(variance + eps)[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + d)[None, :]
    tl.store(base + offs, w * normed, mask=mask)


@triton.jit
def _qk_rms_norm_kernel(q_ptr, k_ptr, q_weight, k_weight, stride_qt, stride_qh, stride_kt, stride_kh,
                        num_q_heads, num_k_heads, eps, HEAD_DIM: tl.constexpr, Q_PAD: tl.constexpr,
                        K_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    _head_rms_norm(q_ptr, q_weight, t, stride_qt, stride_qh, num_q_heads, eps, HEAD_DIM, Q_PAD)
    _head_rms_norm(k_ptr, k_weight, t, stride_kt, stride_kh, num_k_heads, eps, HEAD_DIM, K_PAD)


def qk_rms_norm_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float) -> None:
    """q [T, H, D] and k [T, KVH, D] (views with unit last stride, D a power of two) RMS-normed per head, in
    place; the same arithmetic as RMSNorm (float32 statistics, weight applied in the input dtype)."""
    tokens, num_heads, dim = q.shape
    if tokens == 0:
        return
    _qk_rms_norm_kernel[(tokens,)](q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                   num_heads, k.shape[1], eps, HEAD_DIM=dim,
                                   Q_PAD=triton.next_power_of_2(num_heads), K_PAD=triton.next_power_of_2(k.shape[1]),
                                   **pdl_args())


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, positions, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, num_q_heads, num_k_heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)
    sin = tl.load(sin_ptr + pos * stride_cos + d)
    h = tl.arange(0, HEADS_PAD)
    for which in tl.static_range(2):
        if which == 0:
            base, stride_t, stride_h, num_heads = q_ptr, stride_qt, stride_qh, num_q_heads
        else:
            base, stride_t, stride_h, num_heads = k_ptr, stride_kt, stride_kh, num_k_heads
        mask = (h < num_heads)[:, None]
        offs = t * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + offs + HALF, mask=mask, other=0.0)
        c = cos[None, :].to(x1.dtype)
        s = sin[None, :].to(x1.dtype)
        tl.store(base + offs, x1 * c - x2 * s, mask=mask)
        tl.store(base + offs + HALF, x2 * c + x1 * s, mask=mask)


def rotary_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor) -> None:
    """q [T, H, D], k [T, KVH, D] (views with unit last stride) rotated in place; cos/sin [max_pos, D]."""
    tokens, num_heads, dim = q.shape
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), num_heads, k.shape[1], HALF=dim // 2,
                              HEADS_PAD=triton.next_power_of_2(max(num_heads, k.shape[1])), **pdl_args())


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in up's dtype, the one rounding every fused SiLU-mul shares (this kernel, the GEMVs'
    fused input, the int4 gate_up's output): silu in float32 rounded to up's dtype, the product rounded again."""
    gate = gate.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(gate, up), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(half, block))](gate_up, out, gate_up.stride(0), out.stride(0), half,
                                                           BLOCK=block, **pdl_args())
    return out
