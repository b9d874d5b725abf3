"""Quantized experts (issue 45): `dflash2 convert --expert-quant` and per-layer `experts=` overrides on tiny
mixture-of-experts models, the router kept in 16 bits, the packed experts served on the CPU kernels, dummy
quantized experts."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.cli.main import main as dflash2_main
from dflash2.layers.quant_experts import QuantExperts
from dflash2.loading.model_loader import load_model
from dflash2.models.moe import experts_by_group
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.formats import WeightFormat
from dflash2.quantization.scoring import log_probs
from tests.tiny_models import build_tiny_model
from tests.unit.test_convert_tiny import kl, save_byte_tokenizer

IDS = [ord(c) for c in "mixture of tiny experts"]


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def tiny_moe(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"moe-quant-{request.param}")
    source = str(root / "source")
    build_tiny_model(request.param, source)
    save_byte_tokenizer(source)
    return request.param, source, root


def convert(tiny_moe, name: str, *flags: str) -> str:
    _, source, root = tiny_moe
    out = str(root / name)
    assert dflash2_main(["convert", "--model-path", source, "--output-path", out, "--no-progress", *flags]) == 0
    return out


def cpu_model(path: str, backend: str = "auto"):
    return load_model(path, "auto", "float32", torch.device("cpu"), None, quant_backend=backend).module


def test_expert_quant_with_a_layer_override_keeps_the_router_and_the_rest_as_asked(tiny_moe):
    arch, source, _ = tiny_moe
    out = convert(tiny_moe, "experts-4", "--expert-quant", "4", "--layer-quant", "1:experts=8")
    section = json.load(open(os.path.join(out, "config.json")))["quantization"]
    assert section["experts_quant"] == 4 and section["ffn_quant"] == 16
    assert section["layers"] == {"1": {"experts": 8}}
    module = cpu_model(out)
    sparse = [layer.mlp for layer in module.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == (1 if arch == "qwen3_moe" else 2)  # qwen3's tiny model keeps layer 0 dense
    for block in sparse:
        bits = 8 if block.layer_index == 1 else 4
        for projection in (block.experts.gate_up_proj, block.experts.down_proj):
            assert isinstance(projection, QuantExperts) and projection.fmt.bits == bits
            assert projection.runtimes is not None and len(projection.runtimes) == 8
        assert block.gate.weight.dtype == torch.float32  # the router is never quantized
        if block.shared_expert is not None:  # Qwen2-MoE's shared expert is an ffn tensor: 16 bits here
            assert block.shared_expert.gate_up_proj.fmt.bits == 16
    if arch == "qwen3_moe":  # the dense layer follows ffn
        assert module.layers[0].mlp.gate_up_proj.fmt.bits == 16
    assert sparse[-1].experts.down_proj.fmt == WeightFormat(8)
    if arch == "qwen2_moe":
        assert sparse[0].experts.gate_up_proj.fmt == WeightFormat(4, 64)
        assert sparse[0].experts.down_proj.fmt == WeightFormat(4, 32)  # the largest group dividing I = 32


@pytest.mark.parametrize("bits", ["8", "6", "4"])
def test_quantized_experts_on_the_cpu_kernels_match_their_dequantized_weights(tiny_moe, bits):
    out = convert(tiny_moe, f"all-{bits}", "--expert-quant", bits)
    ours = log_probs(cpu_model(out), IDS)
    reference = log_probs(cpu_model(out, backend="torch"), IDS)  # every expert dequantized, F.linear
    assert kl(ours, reference) < 0.01
    float_model = log_probs(cpu_model(tiny_moe[1]), IDS)
    assert kl(ours, float_model) < (0.05 if bits == "8" else 1.0)  # random tiny models are touchy at low bits
    llm = LLM(out, kv_cache_memory="4MiB")
    try:
        got = llm.generate({"prompt_token_ids": IDS}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert got[0].outputs[0].token_ids[0] == int(ours[-1].argmax())
    finally:
        llm.close()


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_each_expert_multiplies_its_tokens_by_its_dequantized_weight(tiny_moe, backend):
    out = convert(tiny_moe, f"exact-4-{backend}", "--expert-quant", "4")
    block = next(layer.mlp for layer in cpu_model(out, backend).layers if hasattr(layer.mlp, "experts"))
    experts = block.experts
    stacked = [torch.stack([p.dequantized(e) for e in range(p.num_experts)])
               for p in (experts.gate_up_proj, experts.down_proj)]
    x = torch.randn(13, stacked[0].shape[2], generator=torch.Generator().manual_seed(0))
    weights, ids = block.route(x)
    assert len(set(ids.flatten().tolist())) > 4  # many experts take part
    expected = experts_by_group(x, *stacked, weights, ids)
    error = float((experts(x, weights, ids) - expected).norm() / expected.norm())
    assert error < (1e-6 if backend == "torch" else 1e-2)  # the CPU kernels compute in bfloat16


def test_dummy_weights_fill_quantized_experts(tiny_moe):
    _, source, _ = tiny_moe
    quant = QuantConfig.build(16, {"experts": 4})
    module = load_model(source, "dummy", "float32", torch.device("cpu"), None, quantization=quant).module
    projections = [m for m in module.modules() if isinstance(m, QuantExperts)]
    assert projections and all(p.fmt.bits == 4 for p in projections)
    assert all(bool((p.scales != 0).all()) for p in projections)  # every expert was filled
    assert torch.isfinite(log_probs(module, IDS)).all()


def test_bad_expert_flags_are_clear_errors(tiny_moe, capsys):
    _, source, root = tiny_moe
    assert dflash2_main(["convert", "--model-path", source, "--output-path", str(root / "bad"),
                         "--expert-quant", "3"]) == 2
    assert "unsupported bit width '3' for --expert-quant" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tensor group 'expert'"):
        QuantConfig.build(8, {"expert": 4})
    assert QuantConfig.build(8, layer_overrides={0: {"experts": 4}}).bits_for("experts", 0) == 4
    assert QuantConfig.build(8, {"ffn": 6}).bits_for("experts", 3) == 6  # unset: as ffn
    assert QuantConfig.from_dict(QuantConfig.build(8, {"experts": 4}).to_dict()).experts == 4
