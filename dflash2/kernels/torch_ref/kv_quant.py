"""Quantized KV rows in plain torch: the reference the Triton kernels match, and the scoring emulation.

One fp16 scale per row (a token's one head): scale = absmax / qmax, q = floor(x / scale + 0.5) clamped to
[-qmax, qmax] (int8 qmax 127, int4 qmax 7 stored as q + 8 in a nibble, two a byte), fp8 e4m3fn x / scale
clamped to +-448. A zero row gets scale 0 and dequantizes to zeros.

K rows of the integer kinds (int8, int4) are centred first: offset = the midpoint of the row's range, as fp16,
and the row x - offset is quantized as above, so x ~= q * scale + offset. K has channels far from zero (the
rotary pairs of a few large channels), which a symmetric range around 0 spends levels on; centring halves the
KV's KL divergence at int8 and takes int4's perplexity cost from +44% to +22% on the bundled model
(benchmarks/kv_quant_quality.py). V rows are centred already (V alone costs a twentieth of K's KL) and keep
no offset; fp8, a relative format, loses by centring (its small values move away from zero).
"""
from __future__ import annotations

import torch

from dflash2.quantization.formats import pack_int4, unpack_int4

QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
K_OFFSET_KINDS = ("int8", "int4")  # kinds whose K rows carry an fp16 offset
FP16_MAX = 65504.0


def has_k_offset(kind: str) -> bool:
    return kind in K_OFFSET_KINDS


def quantize_kv(x: torch.Tensor, kind: str, key: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (data [..., D] int8 / fp8, or [..., D // 2] uint8 for int4; scale [...] fp16; offset [...]
    fp16 for K rows (`key`) of K_OFFSET_KINDS, else None)."""
    xf = x.float()
    offset = None
    if key and has_k_offset(kind):
        offset = ((xf.amax(dim=-1) + xf.amin(dim=-1)) * 0.5).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        xf = xf - offset.float()[..., None]
    qmax = QMAX[kind]
    scale = (xf.abs().amax(dim=-1) / qmax).clamp(max=FP16_MAX).to(torch.float16)
    sf = scale.float()
    scaled = xf / torch.where(sf == 0, torch.ones_like(sf), sf)[..., None]
    if kind == "fp8":
        return scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale, offset
    q = torch.floor(scaled + 0.5).clamp(-qmax, qmax)
    if kind == "int8":
        return q.to(torch.int8), scale, offset
    return pack_int4(q.to(torch.int32) + 8), scale, offset


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of quantize_kv, as `dtype` (formed in float32)."""
    if kind == "int4":
        values = unpack_int4(data).to(torch.int32) - 8
    else:
        values = data
    x = values.float() * scale.float()[..., None]
    if offset is not None:
        x = x + offset.float()[..., None]
    return x.to(dtype)


def fake_quantize_kv(x: torch.Tensor, kind: str, key: bool = False) -> torch.Tensor:
    """x (K rows if `key`) as it reads back from a `kind` cache ("float" and plain dtypes: the cast only)."""
    if kind in QMAX:
        data, scale, offset = quantize_kv(x, kind, key)
        return dequantize_kv(data, scale, kind, x.dtype, offset)
    return x
