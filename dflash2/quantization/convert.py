"""`dflash2 convert` as a library call: a float checkpoint -> a quantized directory the loader serves.

    source (HF dir | .gguf) --load float32--> module --(calibration texts -> E[x^2] per layer input)-->
    every layer of a quantized skeleton (built on the meta device from the QuantConfig, so a bad group size
    fails before any work) gets its float weight quantized --> model.safetensors + config.json + tokenizer
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from dflash2.config import ModelArchConfig
from dflash2.layers.embedding import QuantEmbedding
from dflash2.layers.quant_experts import QuantExperts
from dflash2.layers.quant_linear import QuantLinear
from dflash2.loading.model_loader import LoadedModel, load_model
from dflash2.loading.tokenizer import TOKENIZER_FILES, bundled_model_path
from dflash2.models import registry
from dflash2.quantization.calibration import collect_activation_stats, read_calibration_texts
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.quantize import quantize

CALIBRATION_METHOD = "activation-weighted clipping search"
EXTRA_FILES = TOKENIZER_FILES + ("special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                                 "vocab.json", "merges.txt")
SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class ConvertOptions:
    model_path: str | None  # None: the bundled model
    output_path: str
    quant: QuantConfig
    calibration_dataset: str | None = None
    calibration_samples: int = 64
    calibration_max_tokens: int = 512
    overwrite: bool = False
    progress: bool = True


def convert(options: ConvertOptions) -> dict[str, Any]:
    """Write the quantized directory; returns a summary. ValueError for bad input, before any heavy work."""
    started = time.perf_counter()
    source = os.path.abspath(options.model_path) if options.model_path else bundled_model_path()
    _check_output(options.output_path, options.overwrite)
    texts = (read_calibration_texts(options.calibration_dataset, options.calibration_samples)
             if options.calibration_dataset else None)
    loaded = load_model(source, "auto", "float32", torch.device("cpu"), None)
    skeleton = _skeleton(loaded.arch, options.quant)
    importance = _calibrate(loaded, texts, options) if texts else {}
    tensors, formats = _quantize_all(loaded.module, skeleton, importance, options.progress)
    quant = dataclasses.replace(options.quant, source=source, calibration=_calibration_record(options, texts))
    _write(options, loaded, source, tensors, quant, formats)
    return {"output_path": os.path.abspath(options.output_path), "source": source,
            "quantization": quant.to_dict(), "formats": formats,
            "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "seconds": round(time.perf_counter() - started, 1)}


def _check_output(path: str, overwrite: bool) -> None:
    if os.path.exists(path):
        if not overwrite:
            raise ValueError(f"output path {path} already exists; choose another or pass --overwrite")
        if not os.path.isdir(path):
            raise ValueError(f"output path {path} exists and is not a directory")


def _skeleton(arch: ModelArchConfig, quant: QuantConfig) -> nn.Module:
    """The quantized model's module tree without storage: its state-dict names, shapes and formats."""
    with torch.device("meta"):
        return registry.model_class(arch.architecture)(arch, 1, quant)


def _calibrate(loaded: LoadedModel, texts: list[str], options: ConvertOptions) -> dict[str, torch.Tensor]:
    if loaded.tokenizer is None:
        raise ValueError("calibration needs a tokenizer, and this checkpoint ships none")
    sequences = [loaded.tokenizer.encode(text)[:options.calibration_max_tokens] for text in texts]
    sequences = [ids for ids in sequences if len(ids) > 1]
    if not sequences:
        raise ValueError(f"calibration dataset {options.calibration_dataset} holds no text of 2 tokens or more")
    with tqdm(total=len(sequences), desc="calibrating", unit="text", disable=not options.progress) as bar:
        return collect_activation_stats(loaded.module, sequences, bar.update)


def _float_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The float weight behind one quantized layer of the skeleton (a tied head reads the embedding; stacked
    experts their stacked parameter)."""
    if name == "lm_head" and getattr(module, "lm_head", None) is None:
        return module.embed_tokens.weight
    parent, _, leaf = name.rpartition(".")
    if leaf in ("gate_up_proj", "down_proj") and parent.endswith(".experts"):
        return getattr(module.get_submodule(parent), leaf)
    return module.get_submodule(name).weight


def _importance(name: str, layer: nn.Module, importance: dict[str, torch.Tensor], tied: bool) -> torch.Tensor | None:
    if not importance:
        return None
    if isinstance(layer, QuantEmbedding):
        key = "lm_head" if tied else None  # one tensor serving the head: weigh by the head's inputs
    else:
        key = name
    if key in importance:
        return importance[key]
    return torch.ones(layer.in_features)  # no activations seen: plain error-minimizing clipping


def _quantize_all(module: nn.Module, skeleton: nn.Module, importance: dict[str, torch.Tensor],
                  progress: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    layers = [(n, m) for n, m in skeleton.named_modules() if isinstance(m, (QuantLinear, QuantExperts))]
    tied = skeleton.lm_head is None
    for name, layer in tqdm(layers, desc="quantizing", unit="tensor", disable=not progress):
        if isinstance(layer, QuantExperts):  # round-to-nearest, expert by expert (no per-expert statistics)
            experts = [quantize(w, layer.fmt) for w in _float_weight(module, name)]
            packed = {suffix: torch.stack([e[suffix] for e in experts]) for suffix in experts[0]}
        else:
            packed = quantize(_float_weight(module, name), layer.fmt, _importance(name, layer, importance, tied))
        tensors.update({f"{name}.{suffix}": t for suffix, t in packed.items()})
        formats[name] = layer.fmt.name
    float_state = module.state_dict()
    for name in skeleton.state_dict():
        if name not in tensors:
            tensors[name] = float_state[name].detach().float().contiguous()
    return tensors, formats


def _calibration_record(options: ConvertOptions, texts: list[str] | None) -> dict[str, Any]:
    if not texts:
        return {"method": "round-to-nearest"}
    return {"method": CALIBRATION_METHOD, "dataset": os.path.abspath(options.calibration_dataset),
            "samples": len(texts), "max_tokens_per_sample": options.calibration_max_tokens}


# -- output --------------------------------------------------------------------------------------------
def _write(options: ConvertOptions, loaded: LoadedModel, source: str, tensors: dict[str, torch.Tensor],
           quant: QuantConfig, formats: dict[str, str]) -> None:
    out = options.output_path
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    _write_safetensors(out, tensors)
    config = _hf_config(source, loaded.arch)
    config["quantization"] = {**quant.to_dict(), "formats": formats}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _write_tokenizer(out, source, loaded)


def _write_safetensors(out: str, tensors: dict[str, torch.Tensor]) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for index, shard in enumerate(shards, 1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, filename), metadata={"format": "pt", "producer": "dflash2 convert"})


def _hf_config(source: str, arch: ModelArchConfig) -> dict[str, Any]:
    """The source's config.json (an HF directory), or transformers' reading of the GGUF metadata."""
    if os.path.isdir(source):
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
        config.pop("quantization", None)
    else:
        from transformers import AutoConfig

        from dflash2.loading.tokenizer import quiet_transformers

        directory, filename = os.path.split(source)
        with quiet_transformers():
            config = AutoConfig.from_pretrained(directory, gguf_file=filename).to_dict()
    _check_same_arch(ModelArchConfig.from_hf_config(config), arch, source)
    return config


def _check_same_arch(written: ModelArchConfig, loaded: ModelArchConfig, source: str) -> None:
    fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size")
    differ = [f for f in fields if getattr(written, f) != getattr(loaded, f)]
    if written.rope.theta != loaded.rope.theta or loaded.rope.freq_factors is not None:
        differ.append("rope")
    if differ:
        raise ValueError(f"cannot write a config.json for {source} that reproduces its architecture "
                         f"(differs in {', '.join(differ)})")


def _write_tokenizer(out: str, source: str, loaded: LoadedModel) -> None:
    if os.path.isdir(source):
        for name in EXTRA_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), os.path.join(out, name))
    elif loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out)
