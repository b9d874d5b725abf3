"""Calibration data and activation statistics.

The dataset is a jsonl file, one text a line: {"text": ...} (or "prompt" / "content"). Each text is tokenized,
cut to `max_tokens`, and run through the float model; hooks on every linear layer's input (and on the final
norm, the tied output projection's input) accumulate the mean square of each input feature, E[x_k^2]. That
vector is the per-column importance the quantizer weighs its error by (quantize.py).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dflash2.quantization.scoring import hidden_states

TEXT_FIELDS = ("text", "prompt", "content")


def read_calibration_texts(path: str, num_samples: int) -> list[str]:
    """The first `num_samples` texts of a jsonl file; ValueError if it is missing, empty or not jsonl."""
    if not os.path.isfile(path):
        raise ValueError(f"calibration dataset {path} does not exist")
    if num_samples < 1:
        raise ValueError(f"--calibration-samples must be >= 1, got {num_samples}")
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            texts.append(_text_of(line, path, number))
            if len(texts) == num_samples:
                break
    if not texts:
        raise ValueError(f"calibration dataset {path} is empty; give a jsonl file with one "
                         f'{{"text": "..."}} object per line')
    return texts


def _text_of(line: str, path: str, number: int) -> str:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration dataset {path}:{number} is not jsonl ({e.msg}); expected one "
                         f'{{"text": "..."}} object per line') from None
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for field in TEXT_FIELDS:
            if isinstance(item.get(field), str) and item[field]:
                return item[field]
    raise ValueError(f'calibration dataset {path}:{number} has no "text" field (nor prompt/content)')


class ActivationStats:
    """Running sum of x^2 per input feature for each named layer."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        x2 = x.detach().float().reshape(-1, x.shape[-1]).pow(2)
        if name not in self.sums:
            self.sums[name] = torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device)
            self.counts[name] = 0
        self.sums[name] += x2.sum(dim=0).double()
        self.counts[name] += x2.shape[0]

    def mean_square(self) -> dict[str, torch.Tensor]:
        return {name: (total / self.counts[name]).float().cpu() for name, total in self.sums.items()}


def collect_activation_stats(module: nn.Module, token_sequences: list[list[int]],
                             progress: Callable[[int], Any] | None = None) -> dict[str, torch.Tensor]:
    """E[x^2] of the input of every linear layer, by module name; the tied head's input is "lm_head"."""
    from dflash2.layers.linear import Linear, silu_and_mul

    stats = ActivationStats()

    def record(name: str, args: tuple, kwargs: dict) -> None:  # down_proj is called on [gate | up], fused
        stats.add(name, silu_and_mul(args[0]) if kwargs.get("silu_mul") else args[0])

    handles = []
    for name, layer in module.named_modules():
        if isinstance(layer, Linear):
            handles.append(layer.register_forward_hook(
                lambda m, args, kwargs, out, name=name: record(name, args, kwargs), with_kwargs=True))
    handles.append(module.norm.register_forward_hook(  # with a residual the norm returns (normed, residual)
        lambda m, args, out: stats.add("lm_head", out[0] if isinstance(out, tuple) else out)))
    try:
        for ids in token_sequences:
            hidden_states(module, ids)
            if progress is not None:
                progress(1)
    finally:
        for handle in handles:
            handle.remove()
    return stats.mean_square()
