"""Hugging Face model directories: config.json plus one or more safetensors files."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from dflash2.config import ModelArchConfig
from dflash2.quantization.config import QuantConfig


def read_hf_config(model_dir: str) -> ModelArchConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json; give a Hugging Face model directory or a .gguf file")
    with open(path) as f:
        return ModelArchConfig.from_hf_config(json.load(f))


def read_quant_config(model_dir: str) -> QuantConfig | None:
    """The `quantization` section `dflash2 convert` writes into config.json, or None for a plain checkpoint."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        section = json.load(f).get("quantization")
    return None if section is None else QuantConfig.from_dict(section)


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file in the directory (sharded checkpoints included)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
