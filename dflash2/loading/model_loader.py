"""Load a model from a Hugging Face directory, a GGUF file, or a named preset with random weights.

    model path ──► .gguf file       ──► gguf_loader (metadata + dequantized tensors)
               ──► directory        ──► hf_loader (config.json + safetensors)
               ──► preset name      ──► registry.PRESETS + dummy weights (load_format="dummy")
    then: registry.model_class(arch)(...) built on the device in the target dtype, weights copied in.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.loading import dummy_loader, hf_loader
from dflash2.loading.tokenizer import bundled_model_path, load_tokenizer
from dflash2.models import registry

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")


@dataclass
class LoadedModel:
    name: str  # what requests call it (the OpenAI `model` field)
    path: str
    arch: ModelArchConfig
    module: nn.Module
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint ships none
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(model: str | None, load_format: str, dtype: str | torch.dtype, device: torch.device,
               max_positions: int | None, seed: int = 0, tokenizer: str | None = None) -> LoadedModel:
    """Load weights and tokenizer. `max_positions` bounds the rotary table (None: the model's own limit)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    path = model or bundled_model_path()
    torch_dtype = resolve_dtype(dtype, device)
    if load_format == "dummy":
        arch = registry.preset(path) if path in registry.PRESETS else _read_arch(path)
        module = _build(arch, torch_dtype, device, max_positions)
        dummy_loader.fill_dummy_weights(module, seed)
        tok = load_tokenizer(tokenizer) if tokenizer else None
        return LoadedModel(path, path, arch, module, tok, torch_dtype, device)
    arch, weights = _open_checkpoint(path, load_format)
    module = _build(arch, torch_dtype, device, max_positions)
    module.load_weights(weights)
    tok = load_tokenizer(tokenizer or path)
    name = os.path.basename(os.path.normpath(path)) if model else "SmolLM2-135M-Instruct"
    return LoadedModel(name, path, arch, module, tok, torch_dtype, device)


def _open_checkpoint(path: str, load_format: str) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    is_gguf = path.endswith(".gguf") and os.path.isfile(path)
    if load_format == "gguf" or (load_format == "auto" and is_gguf):
        from dflash2.loading.gguf_loader import read_gguf
        return read_gguf(path)
    if os.path.isdir(path):
        return hf_loader.read_hf_config(path), hf_loader.iter_safetensors(path)
    if path in registry.PRESETS:
        raise ValueError(f"{path!r} is an architecture preset: load it with load_format='dummy'")
    raise FileNotFoundError(f"model {path!r} is neither a directory with config.json, a .gguf file, "
                            f"nor a preset ({', '.join(registry.PRESETS)})")


def _read_arch(path: str) -> ModelArchConfig:
    return _open_checkpoint(path, "auto")[0]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None) -> nn.Module:
    cls = registry.model_class(arch.architecture)
    with torch.device(device), _default_dtype(dtype):
        module = cls(arch, max_positions or arch.max_position_embeddings)
    return module.eval()
