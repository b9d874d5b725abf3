"""QuantLinear: a linear layer whose weight is stored in a WeightFormat (16, 8, 6 or 4 bits).

    load:     buffers named as on disk (weight | qweight, scales, zeros) are filled from safetensors
    prepare:  a quantized-matmul backend turns them into its runtime form (kernels/dispatch.py)
    forward:  runtime.matmul(x) (+ bias, kept in the model dtype)

Until `prepare` runs, forward dequantizes on every call (correct, slow): the loader always prepares.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight, RuntimeWeight
from dflash2.quantization.formats import WeightFormat, dequantize


def copy_packed(dests: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str) -> None:
    """Copy a format's packed tensors into their buffers; shapes and dtypes must match exactly."""
    for name, dest in dests.items():
        src = tensors[name]
        if src.shape != dest.shape or src.dtype != dest.dtype:
            raise ValueError(f"{what} {name}: expected {tuple(dest.shape)} {dest.dtype}, got {tuple(src.shape)} "
                             f"{src.dtype}")
        dest.copy_(src)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        for suffix, (shape, dtype) in fmt.tensor_shapes(out_features, in_features).items():
            self.register_buffer(suffix, torch.zeros(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.runtime: RuntimeWeight | None = None
        self.gate_up = False  # rows [gate | up]: forward(silu_out=True) may fuse silu(gate) * up (see prepare)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self.fmt.tensor_shapes(self.out_features, self.in_features))

    def packed(self) -> PackedWeight:
        return PackedWeight(self.fmt, self.out_features, self.in_features,
                            {name: getattr(self, name) for name in self.tensor_names})

    def set_packed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a format's tensors in (shapes and dtypes must match exactly)."""
        copy_packed({name: getattr(self, name) for name in self.tensor_names}, tensors, self.fmt.name)
        self.runtime = None

    def prepare(self, backend: Any, dtype: torch.dtype) -> None:
        """The runtime form (the stored tensors stay: an embedding looks rows up in them)."""
        self.runtime = backend.prepare(self.packed(), dtype)
        if self.gate_up and hasattr(self.runtime, "pair_gate_up"):
            self.runtime.pair_gate_up()

    @property
    def fuses_silu_out(self) -> bool:
        """Whether forward(silu_out=True) applies silu(gate) * up in the matmul's own kernel for decode-sized
        batches (a gate_up on the int4 GEMV), rather than in a separate kernel."""
        return getattr(self.runtime, "fuses_silu_out", False) and self.bias is None

    def fuses_silu_out_for(self, x: torch.Tensor) -> bool:
        """Whether forward(x, silu_out=True) is the way to ask for silu(gate) * up (as Linear's: LlamaMLP asks
        either kind); the runtime takes it inside its kernel for decode-sized batches and adds silu_and_mul above."""
        return self.fuses_silu_out

    def fuses_norm(self, rows: int) -> bool:
        """Whether forward(norm=, add_to=) can fold the RMSNorm and the residual add into the matmul's own kernel
        for `rows` activation rows (the int4 GEMV)."""
        return self.bias is None and getattr(self.runtime, "fuses_norm", lambda rows: False)(rows)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.fmt, self.packed().tensors, dtype)

    def forward(self, x: torch.Tensor, silu_mul: bool = False, silu_out: bool = False, norm: nn.Module | None = None,
                add_to: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias); with `silu_mul`, x is a fused [gate | up] and silu(gate) * up goes in; with
        `silu_out` (a gate_up layer, no bias), y is [gate | up] and silu(gate) * up comes out. `norm` (an
        RMSNorm): y is of norm(x); `add_to`: y is added into that tensor (in place), which is returned, and which
        neither of the two kernels before this one may write (TritonWeight.matmul); both only where fuses_norm
        (the caller asks it: LlamaDecoderLayer.fuses_norms), in the matmul's own kernel."""
        if norm is not None or add_to is not None:
            return self.runtime.matmul(x, silu_mul=silu_mul, silu_out=silu_out, add_to=add_to,
                                       norm=None if norm is None else (norm.weight, norm.eps))
        if silu_out:
            if self.fuses_silu_out:
                return self.runtime.matmul(x, silu_mul=silu_mul, silu_out=True)
            from dflash2.layers.linear import silu_and_mul

            return silu_and_mul(self.forward(x, silu_mul))
        if silu_mul and not getattr(self.runtime, "fuses_silu_mul", False):
            from dflash2.layers.linear import silu_and_mul

            x, silu_mul = silu_and_mul(x), False
        if self.runtime is None:
            y = torch.nn.functional.linear(x, self.dequantized(x.dtype))
        elif silu_mul:
            y = self.runtime.matmul(x, silu_mul=True)
        else:
            y = self.runtime.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.name}, bias={self.bias is not None}"
