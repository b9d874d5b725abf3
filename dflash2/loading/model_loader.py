"""Load a model from a Hugging Face directory, a GGUF file, or a named preset with random weights.

    model path ──► .gguf file       ──► gguf_loader (metadata + dequantized tensors)
               ──► directory        ──► hf_loader (config.json + safetensors)
               ──► preset name      ──► registry.PRESETS + dummy weights (load_format="dummy")
    then: registry.model_class(arch)(...) built on the device in the target dtype, weights copied in.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.loading import dummy_loader, hf_loader
from dflash2.loading.tokenizer import bundled_model_path, load_tokenizer
from dflash2.models import registry
from dflash2.quantization.config import QuantConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what requests call the bundled model
logger = logging.getLogger("dflash2")


@dataclass
class LoadedModel:
    name: str  # what requests call it (the OpenAI `model` field)
    path: str
    arch: ModelArchConfig
    module: nn.Module
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint ships none
    dtype: torch.dtype
    device: torch.device
    quant: QuantConfig | None = None  # a converted checkpoint's quantization section


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(model: str | None, load_format: str, dtype: str | torch.dtype, device: torch.device,
               max_positions: int | None, seed: int = 0, tokenizer: str | None = None,
               quant_backend: str = "auto", quantization: QuantConfig | None = None,
               shard: Callable[[nn.Module, ModelArchConfig], nn.Module] | None = None,
               with_tokenizer: bool = True) -> LoadedModel:
    """Load weights and tokenizer. `max_positions` bounds the rotary table (None: the model's own limit).

    A converted directory (config.json with a `quantization` section) builds quantized layers, and so does a GGUF
    file with quantized tensors when `dtype` is "auto" (its native path: Q4_0/Q4_1 as int4, Q8_0 as int8; see
    gguf_loader); any explicit dtype ("float32") dequantizes every tensor to it (the float path). Then
    `quant_backend` (kernels/dispatch.py; "auto" picks by device) prepares their runtime form.
    `quantization` applies to dummy weights only: random weights quantized to that config (benchmarks).
    `shard` cuts the whole loaded module down to one rank's part (parallel/shard.py) and returns it on `device`,
    before it is prepared; a checkpoint is then read on the CPU, so only the part reaches `device` (dummy weights are
    drawn on `device`, as without it, so every rank draws the same numbers as one process would). `with_tokenizer` False: no tokenizer
    (a parallel engine's other ranks never read text).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    path = model or bundled_model_path()
    torch_dtype = resolve_dtype(dtype, device)
    if load_format == "dummy":
        arch = registry.preset(path) if path in registry.PRESETS else _read_arch(path)
        module = _build(arch, torch_dtype, device, max_positions, quantization)
        dummy_loader.fill_dummy_weights(module, seed)
        if shard is not None:
            module = shard(module, arch)
        if quantization is not None:
            prepare_quantized(module, quant_backend, torch_dtype, device)
        tok = load_tokenizer(tokenizer) if tokenizer and with_tokenizer else None
        return LoadedModel(path, path, arch, module, tok, torch_dtype, device, quantization)
    arch, weights, quant = _open_checkpoint(path, load_format, native_gguf=dtype == "auto")
    module = _build(arch, torch_dtype, device if shard is None else torch.device("cpu"), max_positions, quant)
    module.load_weights(weights)
    if shard is not None:
        module = shard(module, arch)
    if quant is not None:
        prepare_quantized(module, quant_backend, torch_dtype, device)
    tok = load_tokenizer(tokenizer or path) if with_tokenizer else None
    name = os.path.basename(os.path.normpath(path)) if model else BUNDLED_MODEL_NAME
    return LoadedModel(name, path, arch, module, tok, torch_dtype, device, quant)


def prepare_quantized(module: nn.Module, backend_name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Give every quantized layer its runtime form from the chosen quantized-matmul backend."""
    from dflash2.kernels.dispatch import quant_matmul_backend
    from dflash2.layers.quant_experts import QuantExperts
    from dflash2.layers.quant_linear import QuantLinear

    backend = quant_matmul_backend(backend_name, device.type)
    for layer in module.modules():
        if isinstance(layer, (QuantLinear, QuantExperts)):
            layer.prepare(backend, dtype)


def _open_checkpoint(path: str, load_format: str, native_gguf: bool = False
                     ) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]], QuantConfig | None]:
    """(architecture, weights, quantization: a converted directory's, or with `native_gguf` a GGUF file's own)."""
    is_gguf = path.endswith(".gguf") and os.path.isfile(path)
    if load_format == "gguf" or (load_format == "auto" and is_gguf):
        from dflash2.loading.gguf_loader import GGUFCheckpoint
        checkpoint = GGUFCheckpoint(path)
        quant = checkpoint.native_quant_config() if native_gguf else None
        if quant is not None:
            logger.info("GGUF weights run in their own precision (%s); --dtype float32 for the float path",
                        quant.describe())
        return checkpoint.arch_config, checkpoint.iter_weights(quant), quant
    if os.path.isdir(path):
        return hf_loader.read_hf_config(path), hf_loader.iter_safetensors(path), hf_loader.read_quant_config(path)
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


def _build(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None,
           quant: QuantConfig | None = None) -> nn.Module:
    cls = registry.model_class(arch.architecture)
    with torch.device(device), _default_dtype(dtype):
        module = cls(arch, max_positions or arch.max_position_embeddings, quant)
    return module.eval()
