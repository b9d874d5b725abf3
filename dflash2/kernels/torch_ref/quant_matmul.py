"""Quantized matmul backends in plain PyTorch.

A backend turns a layer's packed tensors (formats.py, the on-disk layout) into a runtime form once, after
loading, and the runtime form computes  y = x @ W^T  for activations x [M, K]:

    TorchQuantMatmul   ("torch")      dequantize once to the activation dtype; F.linear. The reference.
    CPUPackedMatmul    ("torch_cpu")  PyTorch's CPU weight-only kernels on bfloat16 activations:
        int8   torch._weight_int8pack_mm (int8 [N, K] + per-row scales, used as stored); for M >= 64 rows
               the weight is dequantized to bfloat16 on the fly and F.linear runs (faster for prefill)
        int4   torch._weight_int4pack_mm_for_cpu on the weight repacked by
               torch._convert_weight_to_int4pack_for_cpu; its dequant is (q - 8) * scale + zero, so our
               zero point z (w = (q - z) * scale) becomes its float zero (8 - z) * scale
        int6   no 6-bit kernel exists: q = 4 * hi + lo with hi = q >> 2 (0..15) and lo = q & 3, and
               W = W_hi + W_lo exactly, each an int4 weight (scales 4s and s): two int4 kernel calls
               (8 bits a weight in memory at run time, 6 on disk)
        16     bfloat16 F.linear
        The int4 kernel needs N % 16 == 0 and a group size of 32/64/128/256, the int8 kernel K % 16 == 0 (in
        torch 2.13 it reads past the rows' ends otherwise: wrong sums or a segfault); other shapes fall back
        to a bfloat16 weight dequantized at load.
    The weight-only kernels decode the weight again for every few activation rows (on 2 cores, SmolLM2's layers:
    int4 4.4 ms a step at 1 row, 28 at 16, 117 at 64; a bfloat16 F.linear 21-26 ms at 16-64 rows). So from
    DENSE_MIN_ROWS rows on (batched decode, prefill) a quantized weight runs as F.linear on a bfloat16 copy of
    itself, kept from load while the copies fit DENSE_BUDGET_FRACTION of the memory available then (weights
    prepared after that run dequantized on the fly from DEQUANT_MIN_ROWS rows, and with the kernel below).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash2.quantization.formats import WeightFormat, dequantize, unpack

COMPUTE_DTYPE = torch.bfloat16
DENSE_MIN_ROWS = 16  # from this many rows on, F.linear on a bfloat16 copy beats the weight-only kernels
DEQUANT_MIN_ROWS = 64  # without a copy: from this many rows on, dequantize + F.linear beats them
DENSE_BUDGET_FRACTION = 0.25  # of MemAvailable at load, for the bfloat16 copies


@dataclass
class PackedWeight:
    """One weight matrix in its on-disk layout."""

    fmt: WeightFormat
    out_features: int
    in_features: int
    tensors: dict[str, torch.Tensor]


class RuntimeWeight(Protocol):
    kernel: str  # what runs, for `dflash2 validate`

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...  # x [M, K] -> [M, N] in x's dtype


class DenseWeight:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.kernel = f"F.linear on a dequantized {str(weight.dtype).replace('torch.', '')} weight"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class _WithDenseCopy:
    """A weight-only kernel for few rows; F.linear on a bfloat16 copy (`dense`, if kept) from DENSE_MIN_ROWS rows,
    or on the weight dequantized for the call (`dequantize()`) from DEQUANT_MIN_ROWS rows."""

    dense: torch.Tensor | None = None
    source: PackedWeight | None = None  # the on-disk layout (the layer keeps it): what dequantize() reads

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        xc = x.to(COMPUTE_DTYPE).contiguous()
        if self.dense is not None and rows >= DENSE_MIN_ROWS:
            y = F.linear(xc, self.dense)
        elif rows >= DEQUANT_MIN_ROWS:
            y = F.linear(xc, self.dequantize())
        else:
            y = self.kernel_matmul(xc)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[N, K] in COMPUTE_DTYPE, from the on-disk layout (formats.dequantize, in float32, rounded once)."""
        return dequantize(self.source.fmt, self.source.tensors, COMPUTE_DTYPE)

    def kernel_matmul(self, xc: torch.Tensor) -> torch.Tensor: ...


class Int8Weight(_WithDenseCopy):
    kernel = "torch._weight_int8pack_mm (bf16 activations; F.linear on a bf16 copy from 16 rows, or dequantized from 64)"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        self.qweight = qweight.contiguous()
        self.scales = scales.to(COMPUTE_DTYPE).contiguous()

    def kernel_matmul(self, xc: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(xc, self.qweight, self.scales)


class Int4Weight(_WithDenseCopy):
    kernel = "torch._weight_int4pack_mm_for_cpu (bf16 activations; F.linear on a bf16 copy from 16 rows, or dequantized from 64)"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, float_zeros: torch.Tensor, group_size: int) -> None:
        """codes [N, K] in 0..15; scales and float_zeros [N, K/G]: w = (code - 8) * scale + zero."""
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack((scales.t(), float_zeros.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()
        self.group_size = group_size

    def kernel_matmul(self, xc: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(xc, self.packed, self.group_size, self.scales_and_zeros)


class Int6Weight(_WithDenseCopy):
    kernel = "2 x torch._weight_int4pack_mm_for_cpu (int6 = 4 * high nibble + low 2 bits; F.linear on a bf16 copy from 16 rows)"

    def __init__(self, high: Int4Weight, low: Int4Weight) -> None:
        self.high, self.low = high, low

    def kernel_matmul(self, xc: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(xc, self.high.packed, self.high.group_size, self.high.scales_and_zeros)
        return y.float() + torch._weight_int4pack_mm_for_cpu(xc, self.low.packed, self.low.group_size,
                                                             self.low.scales_and_zeros).float()


class QuantMatmulBackend(Protocol):
    name: str

    def prepare(self, weight: PackedWeight, dtype: torch.dtype) -> RuntimeWeight: ...


class TorchQuantMatmul:
    """The reference: the weight dequantized once, to the model's dtype."""

    name = "torch"

    def prepare(self, weight: PackedWeight, dtype: torch.dtype) -> RuntimeWeight:
        return DenseWeight(dequantize(weight.fmt, weight.tensors, dtype).contiguous())


class CPUPackedMatmul:
    """PyTorch's CPU weight-only int8/int4 kernels (see the module docstring). One instance prepares one model's
    layers, and keeps their bfloat16 copies within its budget."""

    name = "torch_cpu"

    def __init__(self, dense_budget_bytes: int | None = None) -> None:
        self.dense_budget = _available_memory() * DENSE_BUDGET_FRACTION if dense_budget_bytes is None \
            else dense_budget_bytes

    def prepare(self, weight: PackedWeight, dtype: torch.dtype) -> RuntimeWeight:
        fmt, tensors = weight.fmt, weight.tensors
        if fmt.bits == 16:
            return DenseWeight(tensors["weight"].to(COMPUTE_DTYPE).contiguous())
        if not (int8_kernel_fits(weight) if fmt.bits == 8 else int4_kernel_fits(weight)):
            return DenseWeight(dequantize(fmt, tensors, COMPUTE_DTYPE).contiguous())
        if fmt.bits == 8:
            runtime = Int8Weight(tensors["qweight"], tensors["scales"])
        else:
            runtime = _grouped_runtime(weight)
        runtime.source = weight
        copy_bytes = weight.out_features * weight.in_features * 2
        if copy_bytes <= self.dense_budget:
            self.dense_budget -= copy_bytes
            runtime.dense = runtime.dequantize().contiguous()
        return runtime


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 0 where it cannot be read (no copies kept)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def int8_kernel_fits(weight: PackedWeight) -> bool:
    return weight.in_features % 16 == 0


def int4_kernel_fits(weight: PackedWeight) -> bool:
    return (weight.out_features % 16 == 0 and weight.fmt.group_size in (32, 64, 128, 256)
            and weight.in_features % weight.fmt.group_size == 0)


def _grouped_runtime(weight: PackedWeight) -> RuntimeWeight:
    fmt, tensors = weight.fmt, weight.tensors
    codes = unpack(tensors["qweight"], fmt.bits).to(torch.int32)
    scales = tensors["scales"].float()
    zeros = tensors["zeros"].float()
    if fmt.bits == 4:
        return Int4Weight(codes, scales, (8 - zeros) * scales, fmt.group_size)
    high = Int4Weight(codes >> 2, 4 * scales, (32 - zeros) * scales, fmt.group_size)
    low = Int4Weight(codes & 3, scales, 8 * scales, fmt.group_size)
    return Int6Weight(high, low)
