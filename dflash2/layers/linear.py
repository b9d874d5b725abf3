"""Linear layers: `Linear` holds a float weight in the model dtype (plain checkpoints); `make_linear` picks
it or a `QuantLinear` by the weight format the model's quantization config gives the layer.

Both take `silu_mul=True`: the input is the fused [gate | up] projection and the layer multiplies
silu(gate) * up first (on CUDA inside the GEMV for decode-sized batches, one launch fewer a layer).
On CUDA a float weight (a Linear's, or a tied embedding's output projection: `float_matmul`) with one input row
runs the Triton GEMV (kernels/triton/quant_matmul.py), and with up to `SKINNY_MAX_ROWS` the Triton skinny GEMM
where a tune found it faster than cuBLAS (kernels/triton/skinny_gemm.py), instead of cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.layers.quant_linear import QuantLinear
from dflash2.quantization.formats import WeightFormat


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, silu_mul: bool = False, silu_out: bool = False, norm: nn.Module | None = None,
                add_to: torch.Tensor | None = None) -> torch.Tensor:
        """silu_mul: x is [gate | up], multiplied first. silu_out: this is the fused [gate | up] projection and
        the result silu(gate) * up (inside the skinny GEMM where fuses_silu_out_for(x), else one kernel more).
        `norm` (an RMSNorm): the product is of norm(x); `add_to`: it is added into that tensor (in place), which
        is returned; both only where fuses_norm (LlamaDecoderLayer.fuses_norms asks), in the GEMV's own launch."""
        if norm is not None or add_to is not None:
            if not self.fuses_norm(x.shape[0]) or silu_out:
                raise ValueError(f"this layer does not fold a norm or residual add for {x.shape[0]} rows")
            from dflash2.kernels.triton.quant_matmul import gemv_16bit

            return gemv_16bit(x, self.weight, out=add_to, silu_mul=silu_mul, add_out=add_to is not None,
                              norm=None if norm is None else (norm.weight, norm.eps))
        if silu_out:
            config = skinny_config_for(x, self.weight, self.bias)
            if config is not None:
                from dflash2.kernels.triton.skinny_gemm import skinny_gemm

                return skinny_gemm(x, self.weight, config=config, silu_out=True)
            return silu_and_mul(float_matmul(x, self.weight, self.bias))
        return float_matmul(x, self.weight, self.bias, silu_mul)

    def fuses_norm(self, rows: int) -> bool:
        """Whether forward(norm=, add_to=) folds the RMSNorm and the residual add into the matmul for `rows`
        activation rows: the 16-bit GEMV's (CUDA, one row, no bias)."""
        return self.weight.is_cuda and self.bias is None and rows <= DECODE_GEMV_MAX_ROWS

    def fuses_silu_out_for(self, x: torch.Tensor) -> bool:
        """Whether forward(x, silu_out=True) is one kernel: the skinny GEMM's rows, and a config for this shape."""
        return skinny_config_for(x, self.weight, self.bias) is not None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


# One row: the Triton GEMV. 2-16 rows (a small batch's decode step): the skinny GEMM where it has a config for the
# shape, else cuBLAS. The GEMV took up to 4 rows before: on Qwen3-0.6B a decode step of 4 rows took 1.807 ms with
# it against 1.104 ms with skinny + cuBLAS, and one of 12 rows 1.461 ms with cuBLAS against 1.280 with skinny
# (twentieth session, benchmarks/decode_profile.py).
DECODE_GEMV_MAX_ROWS = 1
SKINNY_MAX_ROWS = 16


def float_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias) for a float weight in x's dtype; silu_mul: x is [gate | up], multiplied first.
    On CUDA without a bias: the Triton GEMV up to DECODE_GEMV_MAX_ROWS rows; the skinny GEMM where
    skinny_config_for gives a config (not with silu_mul: silu_and_mul + cuBLAS measured faster than SiLU-mul on
    the skinny GEMM's loads); else cuBLAS."""
    if x.is_cuda and bias is None:
        if x.shape[0] <= DECODE_GEMV_MAX_ROWS:
            from dflash2.kernels.triton.quant_matmul import gemv_16bit

            return gemv_16bit(x, weight, silu_mul=silu_mul)
        config = None if silu_mul else skinny_config_for(x, weight, bias)
        if config is not None:
            from dflash2.kernels.triton.skinny_gemm import skinny_gemm

            return skinny_gemm(x, weight, config=config)
    return F.linear(silu_and_mul(x) if silu_mul else x, weight, bias)


def skinny_config_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> dict | None:
    """The skinny GEMM's config for x @ weight^T, or None where it does not take it: it needs CUDA, no bias,
    DECODE_GEMV_MAX_ROWS < rows <= SKINNY_MAX_ROWS, a 16-bit weight of x's dtype, and a shape the tune found it
    faster on (skinny_gemm.skinny_config)."""
    if not (x.is_cuda and bias is None and DECODE_GEMV_MAX_ROWS < x.shape[0] <= SKINNY_MAX_ROWS
            and weight.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype):
        return None
    from dflash2.kernels.triton.skinny_gemm import skinny_config

    return skinny_config(weight.shape[0], weight.shape[1])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] input (one Triton kernel on CUDA)."""
    if gate_up.is_cuda:
        from dflash2.kernels.triton.elementwise import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_linear(in_features: int, out_features: int, fmt: WeightFormat | None, bias: bool = False) -> nn.Module:
    """A float `Linear` when `fmt` is None (an unquantized model), else a `QuantLinear` in that format."""
    if fmt is None:
        return Linear(in_features, out_features, bias)
    return QuantLinear(in_features, out_features, fmt, bias)
