"""`dflash2 validate` as a library call: check a (converted) model directory and measure what it costs.

    1. structure   safetensors headers against the tensors the config implies (names, shapes, dtypes);
                   NaN/inf in any stored float (weights, scales)                        -> ERROR lines
    2. load        the model through the engine, and what kernel each layer's format runs on
    3. memory      weight bytes per group, KV bytes per token, tokens per GiB, roofline decode step at batch 1
    4. quality     perplexity on the eval text, mean KL divergence against the reference, greedy text;
                   past QualityThresholds' warning bounds a WARNING line, past its error bounds (or an empty or
                   degenerate greedy answer: one token repeated throughout)                      -> ERROR lines
"""
from __future__ import annotations

import glob
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from dflash2.config import ModelArchConfig
from dflash2.loading.hf_loader import read_hf_config, read_quant_config
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.eval_text import EVAL_TEXT

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
                      "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
ROOFLINES_GBS = {"h200": 4270.0, "this_cpu": 23.0}  # measured copy / bf16-matmul streaming rates (DESIGN.md)


@dataclass(frozen=True)
class QualityThresholds:
    """How far from the reference a conversion may be. The defaults: int8 weights and KV cost ~0.7% perplexity
    and KL ~0.006 on the bundled model, the calibrated mixed 4/6/8-bit config ~+5%; 4-bit KV (+41-54%, KL
    ~0.3) is an ERROR: a conversion not to serve."""
    warn_perplexity_pct: float = 10.0
    warn_kl: float = 0.05
    error_perplexity_pct: float = 25.0
    error_kl: float = 0.25


@dataclass(frozen=True)
class ValidateOptions:
    model_path: str
    reference_model: str | None = None  # None: the source recorded in the config
    test_input: str = "The capital of France is"
    max_new_tokens: int = 32
    eval_text: str | None = None  # None: the built-in held-out text
    max_eval_tokens: int = 1024
    kv_cache_dtype: str | None = None  # None: the config's
    context_tokens: int = 1024  # context length for the roofline step time
    thresholds: QualityThresholds = QualityThresholds()


def validate(options: ValidateOptions) -> dict[str, Any]:
    """The report as a dict; `report["errors"]` lists the real problems (the CLI exits non-zero on any)."""
    report: dict[str, Any] = {"model_path": os.path.abspath(options.model_path), "errors": [], "warnings": []}
    if not os.path.isdir(options.model_path):
        report["errors"].append(f"{options.model_path} is not a model directory")
        return report
    try:
        arch = read_hf_config(options.model_path)
        quant = read_quant_config(options.model_path)
    except (ValueError, KeyError, OSError) as e:
        report["errors"].append(f"config.json: {e}")
        return report
    report["quantization"] = None if quant is None else quant.to_dict()
    expected = _expected_tensors(arch, quant, report)
    if expected is None:
        return report
    report["layers"] = _layer_formats(arch, quant)
    report["errors"] += check_tensors(options.model_path, expected)
    report["memory"] = memory_report(arch, quant, expected, options)
    if report["errors"]:
        return report
    _run_models(options, quant, report)
    return report


def _expected_tensors(arch: ModelArchConfig, quant: QuantConfig | None, report: dict[str, Any]
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
    from dflash2.models import registry

    try:
        with torch.device("meta"):
            skeleton = registry.model_class(arch.architecture)(arch, 1, quant)
    except ValueError as e:
        report["errors"].append(f"the quantization config cannot describe this model: {e}")
        return None
    return {name: (tuple(t.shape), t.dtype) for name, t in skeleton.state_dict().items()}


def _layer_formats(arch: ModelArchConfig, quant: QuantConfig | None) -> dict[str, Any]:
    def fmt(group: str, in_features: int, layer: int | None = None) -> str:
        return "float" if quant is None else quant.format_for(group, in_features, layer).name

    q_size = arch.num_heads * arch.head_dim
    layers = {"embed": fmt("embed", arch.hidden_size), "lm_head": fmt("lm_head", arch.hidden_size)}
    for i in range(arch.num_layers):
        layers[str(i)] = {"qkv": fmt("qkv", arch.hidden_size, i), "o_proj": fmt("o_proj", q_size, i),
                          "gate_up": fmt("ffn", arch.hidden_size, i), "down": fmt("ffn", arch.intermediate_size, i)}
    return layers


def check_tensors(model_dir: str, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """ERROR messages for missing, unexpected, wrongly sized or typed tensors, and NaN/inf values."""
    errors: list[str] = []
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return [f"{model_dir} has no *.safetensors files"]
    seen: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                seen.add(name)
                errors += _check_one(f, name, expected.get(name), os.path.basename(file))
    missing = sorted(set(expected) - seen)
    if missing:
        errors.append(f"{len(missing)} tensors the config implies are not on disk: {', '.join(missing[:6])}")
    return errors


def _check_one(f: Any, name: str, want: tuple[tuple[int, ...], torch.dtype] | None, file: str) -> list[str]:
    if want is None:
        return [f"{file}: tensor {name} is not part of the model the config describes"]
    shape = tuple(f.get_slice(name).get_shape())
    dtype = SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
    if shape != want[0]:
        return [f"{file}: tensor {name} has shape {shape}, the config implies {want[0]} "
                f"(a packed tensor of the wrong size, or a config that does not match the tensors)"]
    if want[1].is_floating_point != (dtype is not None and dtype.is_floating_point) or (
            not want[1].is_floating_point and dtype != want[1]):
        return [f"{file}: tensor {name} has dtype {f.get_slice(name).get_dtype()}, expected {want[1]}"]
    if want[1].is_floating_point:
        tensor = f.get_tensor(name)
        bad = int((~torch.isfinite(tensor.float())).sum())
        if bad:
            return [f"{file}: tensor {name} holds {bad} NaN/inf values"]
    return []


def kv_bytes_per_token(arch: ModelArchConfig, kv_dtype: str) -> int:
    """One token's K and V in the engine's page layout, scales included (engine/kv/layout.py)."""
    from dflash2.engine.kv.layout import KVLayout

    return KVLayout.for_model(arch, kv_dtype, 1 << 30).bytes_per_token


def _kv_dtype(options: ValidateOptions, quant: QuantConfig | None) -> str:
    """The KV dtype the report is about, resolved as the engine does: --kv-cache-dtype, else the config's,
    else the model dtype of a GPU deployment (bf16)."""
    from dflash2.engine.kv.layout import resolve_kv_dtype

    return resolve_kv_dtype(options.kv_cache_dtype or "auto", torch.bfloat16, quant.kv_cache_dtype if quant else None)


def memory_report(arch: ModelArchConfig, quant: QuantConfig | None,
                  expected: dict[str, tuple[tuple[int, ...], torch.dtype]], options: ValidateOptions) -> dict[str, Any]:
    by_group: Counter[str] = Counter()
    for name, (shape, dtype) in expected.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        by_group[_group_of(name)] += nbytes
    total = sum(by_group.values())
    tied = "lm_head" not in by_group
    streamed = total - (0 if tied else by_group["embed"])  # a lookup reads a few rows, the head all of them
    kv_dtype = _kv_dtype(options, quant)
    per_token = kv_bytes_per_token(arch, kv_dtype)
    step_bytes = streamed + per_token * options.context_tokens
    return {"weight_bytes": total, "weight_bytes_by_group": dict(by_group),
            "bytes_read_per_decode_step": int(step_bytes), "kv_cache_dtype": kv_dtype,
            "kv_bytes_per_token": per_token, "kv_tokens_per_gib": int(2**30 // per_token),
            "roofline_context_tokens": options.context_tokens,
            "predicted_decode_step_ms": {device: round(step_bytes / (gbs * 1e9) * 1e3, 4)
                                         for device, gbs in ROOFLINES_GBS.items()}}


def _group_of(name: str) -> str:
    for key, group in (("embed_tokens", "embed"), ("lm_head", "lm_head"), ("qkv_proj", "qkv"),
                       ("o_proj", "o_proj"), ("gate_up_proj", "ffn"), ("down_proj", "ffn")):
        if key in name:
            return group
    return "norms"


# -- load and measure ----------------------------------------------------------------------------------
def _run_models(options: ValidateOptions, quant: QuantConfig | None, report: dict[str, Any]) -> None:
    from dflash2 import LLM, SamplingParams
    from dflash2.quantization.scoring import log_probs, perplexity_and_kl

    try:
        llm = LLM(options.model_path, max_num_seqs=4, kv_cache_dtype=options.kv_cache_dtype or "auto")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        report["errors"].append(f"the model does not load: {e}")
        return
    module = llm.engine.model.module
    report["kernels"] = _kernels(module)
    if llm.tokenizer is None:
        report["warnings"].append("the model has no tokenizer: no perplexity, KL divergence or greedy text")
        return
    text = options.eval_text or EVAL_TEXT
    token_ids = llm.tokenizer.encode(text)[:min(options.max_eval_tokens, llm.engine.max_model_len)]
    # the engine's KV dtype (quantized KV is read back through its own format; scoring.py), float for "auto"
    kv_dtype = llm.engine.runner.layout.kv_dtype
    logprobs = log_probs(module, token_ids, kv_dtype)
    reference_path = options.reference_model or (quant.source if quant else None)
    reference = _reference_logprobs(reference_path, token_ids, report) if reference_path else None
    ppl, kl = perplexity_and_kl(logprobs, token_ids, reference)
    report["quality"] = {"eval_tokens": len(token_ids), "perplexity": round(ppl, 4), "kv_cache_dtype": kv_dtype,
                         "mean_kl_divergence": None if kl is None else round(kl, 6),
                         "reference_model": reference_path}
    if reference is not None:
        ref_ppl, _ = perplexity_and_kl(reference, token_ids)
        report["quality"]["reference_perplexity"] = round(ref_ppl, 4)
        report["quality"]["perplexity_change_pct"] = round(100 * (ppl / ref_ppl - 1), 3)
    if not all(torch.isfinite(torch.tensor([ppl]))):
        report["errors"].append("the model's perplexity is not finite (NaN/inf logits)")
    out = llm.generate(options.test_input, SamplingParams(max_tokens=options.max_new_tokens, temperature=0))[0]
    report["greedy"] = {"test_input": options.test_input, "text": out.outputs[0].text,
                        "finish_reason": out.outputs[0].finish_reason}
    judge_quality(report, list(out.outputs[0].token_ids), options.thresholds)


def judge_quality(report: dict[str, Any], greedy_token_ids: list[int], thresholds: QualityThresholds) -> None:
    """WARNING / ERROR lines for a measured quality: perplexity change and mean KL against the reference past
    the thresholds, and a greedy answer that is empty or one token repeated throughout (a broken model's
    usual output: the answer stops at once, or loops on a token)."""
    quality, greedy = report.get("quality") or {}, report.get("greedy")
    checks = (("perplexity_change_pct", "perplexity change against the reference", "%+.2f%%",
               thresholds.warn_perplexity_pct, thresholds.error_perplexity_pct, "perplexity-increase"),
              ("mean_kl_divergence", "mean KL divergence from the reference", "%.4f",
               thresholds.warn_kl, thresholds.error_kl, "kl"))
    for key, what, fmt, warn, error, flag in checks:
        value = quality.get(key)
        if value is None:
            continue
        if value > error:
            report["errors"].append(f"{what} {fmt % value} is above the error bound {fmt % error} "
                                    f"(--error-{flag}): this conversion is broken")
        elif value > warn:
            report["warnings"].append(f"{what} {fmt % value} is above the warning bound {fmt % warn} "
                                      f"(--warn-{flag})")
    if greedy is None:
        return
    if not greedy["text"].strip():
        report["errors"].append(f"the greedy answer to {greedy['test_input']!r} is empty")
    elif len(greedy_token_ids) > 1 and len(set(greedy_token_ids)) == 1:
        report["errors"].append(f"the greedy answer to {greedy['test_input']!r} is degenerate: one token repeated "
                                f"{len(greedy_token_ids)} times")


def _reference_logprobs(path: str, token_ids: list[int], report: dict[str, Any]) -> torch.Tensor | None:
    from dflash2.loading.model_loader import load_model
    from dflash2.quantization.scoring import log_probs

    try:
        reference = load_model(path, "auto", "float32", torch.device("cpu"), None)
    except (ValueError, FileNotFoundError, OSError) as e:
        report["warnings"].append(f"reference model {path} does not load ({e}); no KL divergence")
        return None
    return log_probs(reference.module, token_ids)


def _kernels(module: torch.nn.Module) -> dict[str, int]:
    """How many layers run on each (format, runtime form) pair."""
    from dflash2.layers.quant_linear import QuantLinear

    counts: Counter[str] = Counter()
    for layer in module.modules():
        if isinstance(layer, QuantLinear):
            runtime = layer.runtime.kernel if layer.runtime is not None else "dequantize on every call"
            counts[f"{layer.fmt.name}: {runtime}"] += 1
        elif type(layer).__name__ == "Linear":
            counts["float: F.linear"] += 1
    return dict(counts)
