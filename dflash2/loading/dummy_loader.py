"""Random weights for a named architecture preset (`load_format="dummy"`), for benchmarks."""
from __future__ import annotations

import torch
from torch import nn


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, everything else N(0, 0.02), drawn on the parameters' own device; quantized layers get
    N(0, 0.02) weights quantized (round-to-nearest) to their format."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[device])
    _fill_quantized(model, seed)


def _fill_quantized(model: nn.Module, seed: int) -> None:
    from dflash2.layers.quant_experts import QuantExperts
    from dflash2.layers.quant_linear import QuantLinear
    from dflash2.quantization.quantize import quantize

    layers = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    for index, layer in enumerate(layers):
        device = next(iter(layer.buffers())).device
        generator = torch.Generator(device=device).manual_seed(seed + 1 + index)

        def random_weight() -> torch.Tensor:
            return torch.empty(layer.out_features, layer.in_features, device=device).normal_(0.0, 0.02,
                                                                                             generator=generator)
        if isinstance(layer, QuantExperts):
            for expert in range(layer.num_experts):
                layer.set_expert(expert, quantize(random_weight(), layer.fmt))
        else:
            layer.set_packed(quantize(random_weight(), layer.fmt))
