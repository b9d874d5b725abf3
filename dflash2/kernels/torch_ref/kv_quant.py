"""Quantized KV rows in plain torch: the reference the Triton kernels match, and the scoring emulation.

Symmetric, one fp16 scale per row (a token's one head): scale = absmax / qmax, q = floor(x / scale + 0.5)
clamped to [-qmax, qmax] (int8 qmax 127, int4 qmax 7 stored as q + 8 in a nibble, two a byte), fp8 e4m3fn
x / scale clamped to +-448. A zero row gets scale 0 and dequantizes to zeros.
"""
from __future__ import annotations

import torch

from dflash2.quantization.formats import pack_int4, unpack_int4

QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
FP16_MAX = 65504.0


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D] int8 / fp8, or [..., D // 2] uint8 for int4; scale [...] fp16)."""
    xf = x.float()
    qmax = QMAX[kind]
    scale = (xf.abs().amax(dim=-1) / qmax).clamp(max=FP16_MAX).to(torch.float16)
    sf = scale.float()
    scaled = xf / torch.where(sf == 0, torch.ones_like(sf), sf)[..., None]
    if kind == "fp8":
        return scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale
    q = torch.floor(scaled + 0.5).clamp(-qmax, qmax)
    if kind == "int8":
        return q.to(torch.int8), scale
    return pack_int4(q.to(torch.int32) + 8), scale


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_kv, as `dtype` (the product is formed in float32)."""
    if kind == "int4":
        values = unpack_int4(data).to(torch.int32) - 8
    else:
        values = data
    return (values.float() * scale.float()[..., None]).to(dtype)


def fake_quantize_kv(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as it reads back from a `kind` cache ("float" and plain dtypes: the cast only)."""
    if kind in QMAX:
        return dequantize_kv(*quantize_kv(x, kind), kind, x.dtype)
    return x
