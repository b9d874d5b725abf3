"""Linear layers: `Linear` holds a float weight in the model dtype (plain checkpoints); `make_linear` picks
it or a `QuantLinear` by the weight format the model's quantization config gives the layer."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def make_linear(in_features: int, out_features: int, fmt: WeightFormat | None, bias: bool = False) -> nn.Module:
    """A float `Linear` when `fmt` is None (an unquantized model), else a `QuantLinear` in that format."""
    if fmt is None:
        return Linear(in_features, out_features, bias)
    return QuantLinear(in_features, out_features, fmt, bias)
