"""`dflash2 convert` and `dflash2 validate` on tiny random models (with a 256-token byte-level tokenizer)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2 import LLM, SamplingParams
from dflash2.cli.main import main as dflash2_main
from dflash2.layers.quant_linear import QuantLinear
from dflash2.loading.model_loader import load_model
from dflash2.quantization.formats import WeightFormat
from dflash2.quantization.scoring import log_probs
from tests.tiny_models import build_tiny_model, hf_logprobs

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n",
         "A small boat drifted on the still lake at dawn.", "Numbers: 3, 14, 15, 92, 65, 35."]
MIXED = ["--embed-quant", "8", "--qkv-quant", "4", "--o-proj-quant", "8", "--ffn-quant", "6", "--lm-head-quant", "8",
         "--layer-quant", "1:ffn=8", "--kv-quant", "int8"]


def save_byte_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"convert-{request.param}")
    source = str(root / "source")
    hf_model = build_tiny_model(request.param, source)
    save_byte_tokenizer(source)
    dataset = root / "calibration.jsonl"
    dataset.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return request.param, hf_model, source, str(dataset), root


def run_cli(*argv: str) -> int:
    return dflash2_main(list(argv))


def convert(tiny, name: str, *flags: str) -> str:
    _, _, source, _, root = tiny
    out = str(root / name)
    assert run_cli("convert", "--model-path", source, "--output-path", out, "--no-progress", *flags) == 0
    return out


def test_mixed_calibrated_convert_writes_a_directory_the_engine_serves(tiny):
    arch, hf_model, source, dataset, _ = tiny
    out = convert(tiny, "mixed", *MIXED, "--calibration-dataset", dataset, "--calibration-samples", "3")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    section = json.load(open(os.path.join(out, "config.json")))["quantization"]
    assert (section["embed_quant"], section["qkv_quant"], section["o_proj_quant"], section["ffn_quant"],
            section["kv_quant"]) == (8, 4, 8, 6, "int8")
    assert section["layers"] == {"1": {"ffn": 8}} and section["calibration"]["samples"] == 3
    assert section["source"] == os.path.abspath(source)
    llm = LLM(out, kv_cache_memory="4MiB")
    module = llm.engine.model.module
    assert module.layers[0].self_attn.qkv_proj.fmt == WeightFormat(4, 64)
    assert module.layers[0].mlp.down_proj.fmt == WeightFormat(6, 128)
    assert module.layers[1].mlp.down_proj.fmt == WeightFormat(8)
    assert all(layer.runtime is not None for layer in module.modules() if isinstance(layer, QuantLinear))
    ids = [ord(c) for c in "hello tiny model"]
    ours = log_probs(module, ids)  # the CPU kernels
    dequantized = log_probs(load_model(out, "auto", "float32", torch.device("cpu"), None, quant_backend="torch").module,
                            ids)
    assert kl(ours, dequantized) < 0.01
    assert kl(ours, hf_logprobs(hf_model, ids)) < 1.0  # random tiny models are touchy: int8 alone gives ~0.05
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[0] == int(ours[-1].argmax())


def kl(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(logprobs, reference, log_target=True, reduction="none").sum(-1).mean())


def test_more_bits_stay_closer_to_the_float_model(tiny):
    arch, hf_model, *_ = tiny
    ids = [ord(c) for c in "more bits, less error"]
    reference = hf_logprobs(hf_model, ids)
    errors = [kl(log_probs(LLM(convert(tiny, f"all-{bits}", "--dtype", bits), kv_cache_memory="4MiB")
                           .engine.model.module, ids), reference) for bits in ("16", "8", "4")]
    assert errors[0] < 0.01 and errors[0] < errors[1] < errors[2]


def test_tied_head_is_shared_only_when_the_formats_agree(tiny):
    arch, *_ = tiny
    same = load_file(os.path.join(convert(tiny, "same", "--dtype", "int8"), "model.safetensors"))
    differ = load_file(os.path.join(convert(tiny, "differ", "--dtype", "int8", "--lm-head-quant", "4"),
                                    "model.safetensors"))
    tied = arch == "qwen2"
    assert ("lm_head.qweight" in same) == (not tied)
    assert "lm_head.qweight" in differ and differ["lm_head.qweight"].shape == (256, 32)


def test_convert_errors_are_clear(tiny, capsys):
    _, _, source, dataset, root = tiny
    existing = convert(tiny, "exists", "--dtype", "int8")
    empty = root / "empty.jsonl"
    empty.write_text("\n")
    not_jsonl = root / "plain.txt"
    not_jsonl.write_text("just some words\n")
    cases = [
        (["--output-path", existing, "--dtype", "int8"], "already exists; choose another or pass --overwrite"),
        (["--output-path", str(root / "a"), "--ffn-quant", "3"], "unsupported bit width '3' for --ffn-quant"),
        (["--output-path", str(root / "b"), "--dtype", "int4", "--group-size", "128"],
         "group size 128 does not divide the row of 64 weights"),
        (["--output-path", str(root / "c"), "--dtype", "int8", "--calibration-dataset", str(empty)], "is empty"),
        (["--output-path", str(root / "d"), "--dtype", "int8", "--calibration-dataset", str(not_jsonl)],
         "is not jsonl"),
        (["--output-path", str(root / "e"), "--kv-quant", "int8", "--kv-cache-dtype", "fp8"], "disagree"),
    ]
    for flags, message in cases:
        assert run_cli("convert", "--model-path", source, "--no-progress", *flags) == 2
        assert message in capsys.readouterr().err
    assert run_cli("convert", "--model-path", source, "--output_path", existing, "--dtype", "int8",
                   "--overwrite", "--no-progress") == 0


def test_validate_reports_and_flags_broken_tensors(tiny, capsys):
    _, _, _, _, root = tiny
    out = convert(tiny, "validate", *MIXED)
    capsys.readouterr()
    report_path = str(root / "report.json")
    # a random tiny model is touchy (KL ~0.7 at these bits) and says nothing readable: validate reports it all, and
    # its quality verdicts (ERROR lines past the KL bound, for an empty or degenerate greedy answer) fail it
    assert run_cli("validate", "--model-path", out, "--output", report_path, "--max-new-tokens", "4") == 1
    printed = capsys.readouterr().out
    assert "layer   0: qkv int4-g64" in printed and "ERROR: model.safetensors" not in printed
    report = json.load(open(report_path))
    assert report["errors"] and all("mean KL" in e or "greedy answer" in e for e in report["errors"])
    assert report["layers"]["1"]["down"] == "int8-per-channel"
    assert report["memory"]["kv_cache_dtype"] == "int8" and report["memory"]["kv_tokens_per_gib"] > 0
    assert report["quality"]["perplexity"] > 1 and report["quality"]["mean_kl_divergence"] >= 0
    assert "int4pack" in " ".join(report["kernels"])
    assert report["greedy"]["finish_reason"] == "length"

    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["layers.0.self_attn.qkv_proj.qweight"] = tensors["layers.0.self_attn.qkv_proj.qweight"][:, :-2].clone()
    tensors["layers.1.mlp.down_proj.scales"][0] = float("nan")
    save_file(tensors, path)
    assert run_cli("validate", "--model_path", out) == 1
    printed = capsys.readouterr().out
    assert "ERROR: model.safetensors: tensor layers.0.self_attn.qkv_proj.qweight has shape" in printed
    assert "ERROR: model.safetensors: tensor layers.1.mlp.down_proj.scales holds 1 NaN/inf" in printed


def test_quality_verdicts_warn_then_fail_past_their_bounds():
    """judge_quality: perplexity change and mean KL against the reference give a WARNING past the warning bounds
    and an ERROR past the error bounds (defaults 10% / 0.05 and 25% / 0.25); an empty greedy answer, or one token
    repeated throughout, is an ERROR; a missing reference (no KL, no change) judges the greedy answer only."""
    from dflash2.quantization.validate import QualityThresholds, judge_quality

    def verdicts(change: float | None, kl: float | None, text: str = " Paris.", token_ids: tuple = (3, 4, 5),
                 thresholds: QualityThresholds = QualityThresholds()) -> tuple[list[str], list[str]]:
        report = {"errors": [], "warnings": [], "quality": {"perplexity_change_pct": change, "mean_kl_divergence": kl},
                  "greedy": {"test_input": "The capital of France is", "text": text}}
        judge_quality(report, list(token_ids), thresholds)
        return report["warnings"], report["errors"]

    assert verdicts(0.7, 0.006) == ([], [])  # int8 weights and KV on the bundled model
    warnings, errors = verdicts(17.4, 0.158)  # int8 weights, 4-bit KV
    assert errors == [] and len(warnings) == 2 and "+17.40%" in warnings[0] and "0.1580" in warnings[1]
    warnings, errors = verdicts(54.9, 0.33, text="")  # the broken conversion
    assert warnings == [] and len(errors) == 3
    assert "+54.90% is above the error bound +25.00% (--error-perplexity-increase)" in errors[0]
    assert "0.3300 is above the error bound 0.2500 (--error-kl)" in errors[1] and "is empty" in errors[2]
    assert verdicts(3.0, 0.07)[0] == ["mean KL divergence from the reference 0.0700 is above the warning bound "
                                      "0.0500 (--warn-kl)"]
    assert verdicts(None, None, text=" the the the", token_ids=(7, 7, 7))[1] == [
        "the greedy answer to 'The capital of France is' is degenerate: one token repeated 3 times"]
    assert verdicts(None, None, text="\n\n", token_ids=(9, 9))[1][0].endswith("is empty")
    assert verdicts(None, None, text=" Paris", token_ids=(8,)) == ([], [])  # one token is no loop
    assert verdicts(30.0, 0.3, thresholds=QualityThresholds(error_perplexity_pct=50, error_kl=1))[1] == []


def test_dummy_weights_can_be_quantized_for_benchmarks(tiny):
    from dflash2.quantization.config import QuantConfig

    _, _, source, _, _ = tiny
    model = load_model(source, "dummy", "float32", torch.device("cpu"), None, quantization=QuantConfig.build(4))
    layer = model.module.layers[0].mlp.gate_up_proj
    assert layer.fmt == WeightFormat(4, 64) and "int4pack" in layer.runtime.kernel
    assert float(layer.dequantized().std()) == pytest.approx(0.02, rel=0.2)
    assert torch.isfinite(log_probs(model.module, [1, 2, 3])).all()
