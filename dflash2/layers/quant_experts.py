"""QuantExperts: one projection of every expert of a mixture-of-experts layer, stacked, in a WeightFormat.

    buffers   the format's tensors with a leading expert dimension, named as on disk:
              int8  qweight [E, N, K] int8,        scales [E, N] f16
              int4  qweight [E, N, K/2] uint8,     scales, zeros [E, N, K/G] f16     (int6: qweight [E, N, 3K/4])
    CUDA      the fused MoE kernel reads the packed bytes of the experts a step selects (kernels/triton/fused_moe.py)
    CPU       `prepare` gives each expert the runtime form of the quantized-matmul backend (the dense layers' CPU
              kernels), so a step multiplies each selected expert's tokens by its packed weight

The stacked layout is formats.py's per-matrix layout with one matrix per expert: expert e is `tensors[name][e]`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight, RuntimeWeight
from dflash2.layers.quant_linear import copy_packed
from dflash2.quantization.formats import WeightFormat, dequantize


class QuantExperts(nn.Module):
    def __init__(self, num_experts: int, out_features: int, in_features: int, fmt: WeightFormat) -> None:
        super().__init__()
        if fmt.bits == 16:
            raise ValueError("QuantExperts holds quantized experts; 16-bit experts are a plain stacked parameter")
        self.num_experts, self.out_features, self.in_features, self.fmt = num_experts, out_features, in_features, fmt
        for suffix, (shape, dtype) in fmt.tensor_shapes(out_features, in_features).items():
            self.register_buffer(suffix, torch.zeros((num_experts, *shape), dtype=dtype))
        self.runtimes: list[RuntimeWeight] | None = None  # per expert, on the CPU (see prepare)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.fmt.tensor_shapes(self.out_features, self.in_features))

    def expert(self, index: int) -> PackedWeight:
        """Expert `index`'s matrix in formats.py's per-matrix layout (views, no copy)."""
        return PackedWeight(self.fmt, self.out_features, self.in_features,
                            {name: getattr(self, name)[index] for name in self.tensor_names})

    def set_expert(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one expert's packed tensors in (quantize()'s output for an [N, K] weight)."""
        copy_packed(self.expert(index).tensors, tensors, f"{self.fmt.name} expert {index}")
        self.runtimes = None

    def prepare(self, backend: Any, dtype: torch.dtype) -> None:
        """On the CPU, each expert's runtime form from the backend (the fused kernel on CUDA needs none)."""
        if self.qweight.is_cuda:
            self.runtimes = None
            return
        self.runtimes = [backend.prepare(self.expert(e), dtype) for e in range(self.num_experts)]

    def dequantized(self, index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.fmt, self.expert(index).tensors, dtype)

    def kernel_arguments(self, prefix: str) -> dict[str, Any]:
        """The fused MoE kernel's keyword arguments for this projection (prefix "gate_up" or "down")."""
        arguments: dict[str, Any] = {f"{prefix}_scales": self.scales}
        if self.fmt.grouped:
            arguments[f"{prefix}_zeros"] = self.zeros
        return arguments

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, out={self.out_features}, in={self.in_features}, {self.fmt.name}"
