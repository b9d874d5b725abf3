"""Random weights for a named architecture preset (`load_format="dummy"`), for benchmarks."""
from __future__ import annotations

import torch
from torch import nn


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, everything else N(0, 0.02), drawn on the parameters' own device."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[device])
