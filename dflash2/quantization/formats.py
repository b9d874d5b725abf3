"""Weight formats and their packed layouts on disk (the contract every matmul backend reads).

    bits 16   weight [N, K] bfloat16
    bits 8    qweight [N, K] int8, symmetric per output channel:   w = q * scales[n]        scales [N] f16
    bits 4    qweight [N, K/2] uint8, asymmetric per group of G along K, with a float zero point:
              w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]    scales, zeros [N, K/G] f16
              byte j of a row holds q[2j] in its low nibble and q[2j+1] in its high nibble
    bits 6    qweight [N, 3K/4] uint8, same scales/zeros as int4, q in 0..63; every 4 weights take 3 bytes,
              little-endian:  bits 0-5 q[4j], 6-11 q[4j+1], 12-17 q[4j+2], 18-23 q[4j+3]

N is the output features (rows), K the input features. G is 128, or the largest of 128/64/32 dividing K
unless given explicitly. Everything here is plain torch on any device; the fast kernels live in kernels/.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_BITS = (16, 8, 6, 4)
GROUP_SIZES = (128, 64, 32)
ALLOWED_GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPE = torch.float16
HALF_DTYPE = torch.bfloat16  # the 16-bit format


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix is stored: bit width and (for 4/6 bits) the group size along the input."""

    bits: int
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in WEIGHT_BITS:
            raise ValueError(f"unsupported bit width {self.bits}; supported: {', '.join(map(str, WEIGHT_BITS))}")
        if self.grouped and self.group_size is None:
            raise ValueError(f"int{self.bits} needs a group size")

    @property
    def grouped(self) -> bool:
        return self.bits in (4, 6)

    @property
    def name(self) -> str:
        if self.bits == 16:
            return "bf16"
        return f"int{self.bits}" + (f"-g{self.group_size}" if self.grouped else "-per-channel")

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors this format stores for an [out, in] weight: suffix -> (shape, dtype)."""
        n, k = out_features, in_features
        if self.bits == 16:
            return {"weight": ((n, k), HALF_DTYPE)}
        if self.bits == 8:
            return {"qweight": ((n, k), torch.int8), "scales": ((n,), SCALE_DTYPE)}
        groups = k // self.group_size
        packed = k // 2 if self.bits == 4 else k * 3 // 4
        return {"qweight": ((n, packed), torch.uint8), "scales": ((n, groups), SCALE_DTYPE),
                "zeros": ((n, groups), SCALE_DTYPE)}

    def storage_bytes(self, out_features: int, in_features: int) -> int:
        return sum(_numel(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in self.tensor_shapes(out_features, in_features).values())


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def resolve_group_size(in_features: int, requested: int | None, where: str = "") -> int:
    """The group size for a row of `in_features` weights (see the module docstring); ValueError if none fits."""
    at = f" ({where})" if where else ""
    if requested is not None:
        if requested not in ALLOWED_GROUP_SIZES:
            raise ValueError(f"group size {requested} is not supported; use one of "
                             f"{', '.join(map(str, ALLOWED_GROUP_SIZES))}")
        if in_features % requested:
            raise ValueError(f"group size {requested} does not divide the row of {in_features} weights{at}")
        return requested
    for size in GROUP_SIZES:
        if in_features % size == 0:
            return size
    raise ValueError(f"no group size of {', '.join(map(str, GROUP_SIZES))} divides the row of {in_features} "
                     f"weights{at}; quantize this tensor to 8 or 16 bits")


# -- bit packing ---------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., K] integers 0..15 -> [..., K/2] uint8 (even k in the low nibble)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 in 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int6(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..63 (K a multiple of 4) -> [N, 3K/4] uint8, 4 weights in 3 bytes."""
    n, k = q.shape
    q = q.to(torch.int32).view(n, k // 4, 4)
    word = q[..., 0] | (q[..., 1] << 6) | (q[..., 2] << 12) | (q[..., 3] << 18)
    packed = torch.stack((word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF), dim=-1)
    return packed.to(torch.uint8).view(n, k * 3 // 4)


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """[N, 3K/4] uint8 -> [N, K] uint8 in 0..63."""
    n, nbytes = packed.shape
    b = packed.view(n, nbytes // 3, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    q = torch.stack((word & 63, (word >> 6) & 63, (word >> 12) & 63, (word >> 18) & 63), dim=-1)
    return q.to(torch.uint8).view(n, nbytes // 3 * 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_int4(packed) if bits == 4 else unpack_int6(packed)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_int4(q) if bits == 4 else pack_int6(q)


# -- dequantization (the reference every kernel is tested against) --------------------------------------
def dequantize(fmt: WeightFormat, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [N, K] weight the packed tensors stand for."""
    if fmt.bits == 16:
        return tensors["weight"].to(dtype)
    if fmt.bits == 8:
        return (tensors["qweight"].float() * tensors["scales"].float()[:, None]).to(dtype)
    q = unpack(tensors["qweight"], fmt.bits).float()
    n, k = q.shape
    groups = q.view(n, k // fmt.group_size, fmt.group_size)
    scales = tensors["scales"].float()[..., None]
    zeros = tensors["zeros"].float()[..., None]
    return ((groups - zeros) * scales).view(n, k).to(dtype)


def dequantize_rows(fmt: WeightFormat, tensors: dict[str, torch.Tensor], rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Dequantize only some rows (an embedding lookup)."""
    return dequantize(fmt, {name: t[rows] for name, t in tensors.items()}, dtype)
