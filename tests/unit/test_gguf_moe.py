"""Mixture-of-experts GGUF files (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against the same models loaded from their
Hugging Face directories.

Each tiny random model (tests/tiny_models.py) is written the way llama.cpp's convert_hf_to_gguf.py lays it out:
the experts stacked (blk.N.ffn_{gate,up,down}_exps [E, rows, columns]), the router ffn_gate_inp, Qwen2-MoE's shared
expert (ffn_*_shexp, ffn_gate_inp_shexp [1, H]), q/k rows permuted for `llama` (Mixtral), the `{arch}.expert_*`
keys. The experts are stored as Q8_0, Q4_0, F16 or BF16 (a few other tensors as F16); the HF model's weights are
first rounded to what their type holds (blocks run along rows, so rounding commutes with stacking and the q/k row
permutation) and saved again, so both loads hold the same numbers and must give the same tokens and logprobs.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from dflash2 import LLM, SamplingParams
from dflash2.layers.quant_linear import QuantLinear
from dflash2.loading.gguf_loader import GGUFCheckpoint
from dflash2.loading.hf_loader import iter_safetensors, read_hf_config
from tests.tiny_models import MOE_ARCHS, build_tiny_model, random_prompts
from tests.unit.test_gguf_loader import _llama_cpp_permute, write_tensors_and_close

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# GGUF tensor kind -> stored type, per family (everything else F32): every expert type appears in one family.
STORED_TYPES = {
    "mixtral": {**dict.fromkeys(EXPERTS, QType.Q8_0), "attn_q": QType.F16, "attn_k": QType.F16},
    "qwen2_moe": {**dict.fromkeys(EXPERTS, QType.F16), **dict.fromkeys(SHARED, QType.F16)},
    "qwen3_moe": {**dict.fromkeys(EXPERTS, QType.Q4_0), "ffn_gate": QType.F16},  # layer 0 is dense
    "olmoe": dict.fromkeys(EXPERTS, QType.BF16),
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {  # HF name after `model.layers.N.` -> GGUF name after `blk.N.` (llama.cpp's gguf-py tensor mapping)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight":
    "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _round(values: np.ndarray, qtype: QType) -> np.ndarray:
    return values if qtype == QType.F32 else gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)


def _gguf_values(state: dict[str, torch.Tensor], config) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values in llama.cpp's layout: stacked gate/up split, q/k permuted for Mixtral."""
    out = {}
    for name, tensor in state.items():
        values = tensor.numpy()
        if name in _GLOBAL:
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                out[_GLOBAL[name]] = values
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first
            inter = values.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = values[:, :inter]
            out[f"blk.{layer}.ffn_up_exps.weight"] = values[:, inter:]
            continue
        if config.model_type == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = config.num_attention_heads if "q_proj" in rest else config.num_key_value_heads
            values = _llama_cpp_permute(values, heads)
        out[f"blk.{layer}.{_LAYER[rest]}"] = values
    return out


def _write_gguf(path: Path, arch: str, config, tensors: dict[str, tuple[np.ndarray, QType]]) -> str:
    gguf_arch = GGUF_ARCH[arch]
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)  # (OLMoE's converter writes 1e-5, its checkpoints' value)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "clip_qkv", None) is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    write_tensors_and_close(writer, tensors)
    return str(path)


def _stored_type(gguf_name: str, types: dict[str, QType]) -> QType:
    kind = gguf_name.split(".")[-2]
    return types.get(kind, QType.F32) if gguf_name.startswith("blk.") else QType.F32


def write_family(arch: str, directory: Path, types: dict[str, QType], **overrides) -> tuple[str, str]:
    """A tiny model of this family (`overrides`: config fields) as an HF directory and a GGUF file holding the
    same numbers: (directory, GGUF path)."""
    hf_dir = directory / "hf"
    model = build_tiny_model(arch, str(hf_dir), **overrides)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    stored = {}
    for name, values in _gguf_values(state, model.config).items():
        qtype = _stored_type(name, types)
        values = np.ascontiguousarray(values, dtype=np.float32)
        stored[name] = (values if qtype == QType.F32 else gguf.quants.quantize(values, qtype), qtype)
    with torch.no_grad():  # the HF weights rounded as stored, rows in place
        for name, tensor in model.state_dict().items():
            kind = _LAYER.get(name.split(".", 3)[-1], "").split(".")[0]
            if name.endswith("mlp.experts.gate_up_proj"):
                kind = "ffn_gate_exps"
            qtype = types.get(kind, QType.F32) if name.startswith("model.layers.") else QType.F32
            tensor.copy_(torch.from_numpy(_round(tensor.numpy(), qtype)))
    model.save_pretrained(str(hf_dir), max_shard_size="200KB")
    return str(hf_dir), _write_gguf(directory / f"{arch}.gguf", arch, model.config, stored)


def make_llm(path: str, tokenizer: str | None = None, **kwargs) -> LLM:
    options = dict(page_bytes=2048, prefill_chunk_size=5, max_num_batched_tokens=16, kv_cache_memory=256 * 2048)
    return LLM(path, tokenizer=tokenizer, **{**options, **kwargs})


@pytest.fixture(scope="module", params=MOE_ARCHS)
def family(request, tmp_path_factory) -> tuple[str, str, str]:
    arch = request.param
    hf_dir, gguf_path = write_family(arch, tmp_path_factory.mktemp(arch), STORED_TYPES[arch])
    return arch, hf_dir, gguf_path


def test_config_equals_hf(family) -> None:
    arch, hf_dir, gguf_path = family
    ours = GGUFCheckpoint(gguf_path).arch_config
    reference = read_hf_config(hf_dir)
    assert ours.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)  # stored as float32
    assert ours == reference.replace(torch_dtype=None, rms_norm_eps=ours.rms_norm_eps)
    assert ours.num_experts == 8 and (ours.shared_expert_intermediate_size > 0) == (arch == "qwen2_moe")


def test_greedy_tokens_logprobs_and_weights_equal_the_hf_directory(family) -> None:
    arch, hf_dir, gguf_path = family
    ours, reference = make_llm(gguf_path, tokenizer=hf_dir), make_llm(hf_dir)
    reference_state = reference.engine.model.module.state_dict()
    for name, tensor in ours.engine.model.module.state_dict().items():
        assert torch.equal(tensor, reference_state[name]), name  # every weight, experts stacked alike
    greedy = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    batch = [{"prompt_token_ids": prompt} for prompt in random_prompts(2, seed=7)]
    got, expected = ours.generate(batch, greedy), reference.generate(batch, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    prompt = {"prompt_token_ids": random_prompts(1, seed=9)[0]}
    got, expected = ours.generate(prompt, params)[0], reference.generate(prompt, params)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    for entries, reference_entries in ((got.prompt_logprobs[1:], expected.prompt_logprobs[1:]),
                                       (got.outputs[0].logprobs, expected.outputs[0].logprobs)):
        for entry, reference_entry in zip(entries, reference_entries, strict=True):
            assert entry.keys() == reference_entry.keys()
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(reference_entry[token_id].logprob, abs=1e-4)


def test_native_path_quantizes_the_shared_expert_not_the_experts(tmp_path: Path) -> None:
    """The default dtype keeps Q8_0 attention and shared-expert tensors as int8; routers and experts stay float."""
    types = {**dict.fromkeys(EXPERTS, QType.Q8_0), **dict.fromkeys(SHARED, QType.Q8_0),
             **dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), QType.Q8_0)}
    hf_dir, gguf_path = write_family("qwen2_moe", tmp_path, types, shared_expert_intermediate_size=64)  # Q8_0 rows
    quant = GGUFCheckpoint(gguf_path).native_quant_config()
    assert quant is not None and {group: quant.bits_for(group, 0) for group in ("qkv", "o_proj", "ffn")} == {
        "qkv": 8, "o_proj": 8, "ffn": 8}
    ours = make_llm(gguf_path, tokenizer=hf_dir)
    layer = ours.engine.model.module.layers[1].mlp
    reference = dict(iter_safetensors(hf_dir))
    assert isinstance(layer.shared_expert.gate_up_proj, QuantLinear)
    gate_up = [torch.cat([reference[f"model.layers.1.mlp.experts.{expert}.{projection}_proj.weight"]
                          for projection in ("gate", "up")]) for expert in range(8)]  # saved per expert
    assert torch.equal(layer.experts.gate_up_proj, torch.stack(gate_up))
    assert torch.equal(layer.gate.weight, reference["model.layers.1.mlp.gate.weight"])
    output = ours.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, min_tokens=4))[0]
    assert len(output.outputs[0].token_ids) == 4


def _tiny_llama_experts(tmp_path: Path, tensors: dict[str, np.ndarray], weights_norm: bool | None = None) -> str:
    """A one-layer Mixtral-like `llama` GGUF holding `tensors` besides the attention and norms."""
    writer = gguf.GGUFWriter(str(tmp_path / "experts.gguf"), "llama")
    if weights_norm is not None:
        writer.add_expert_weights_norm(weights_norm)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 32), (writer.add_head_count, 4), (writer.add_expert_count, 2),
                       (writer.add_expert_used_count, 1), (writer.add_vocab_size, 16)):
        add(value)
    base = {"token_embd.weight": (16, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
            "blk.0.ffn_norm.weight": (64,), "blk.0.ffn_gate_inp.weight": (2, 64)}
    base.update({f"blk.0.attn_{kind}.weight": (64, 64) for kind in ("q", "k", "v", "output")})
    for name, values in {**{name: np.zeros(shape, np.float32) for name, shape in base.items()}, **tensors}.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(tmp_path / "experts.gguf")


def test_per_expert_mixtral_layout_is_refused(tmp_path: Path) -> None:
    old = {f"blk.0.ffn_{kind}.{expert}.weight": np.zeros((64, 32) if kind == "down" else (32, 64), np.float32)
           for kind in ("gate", "up", "down") for expert in range(2)}
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.0\.weight'.*old per-expert Mixtral layout"):
        GGUFCheckpoint(_tiny_llama_experts(tmp_path, old))


def test_stacked_gate_without_up_is_refused(tmp_path: Path) -> None:
    half = {"blk.0.ffn_gate_exps.weight": np.zeros((2, 32, 64), np.float32),
            "blk.0.ffn_down_exps.weight": np.zeros((2, 64, 32), np.float32)}
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' has no 'blk\.0\.ffn_up_exps\.weight'"):
        GGUFCheckpoint(_tiny_llama_experts(tmp_path, half))


def test_mixtral_from_stacked_llama_file(tmp_path: Path) -> None:
    """A `llama` file with experts is Mixtral; its stacked experts come out as the model's stacked parameters."""
    rng = np.random.default_rng(0)
    experts = {"blk.0.ffn_gate_exps.weight": rng.standard_normal((2, 32, 64)).astype(np.float32),
               "blk.0.ffn_up_exps.weight": rng.standard_normal((2, 32, 64)).astype(np.float32),
               "blk.0.ffn_down_exps.weight": rng.standard_normal((2, 64, 32)).astype(np.float32)}
    checkpoint = GGUFCheckpoint(_tiny_llama_experts(tmp_path, experts))
    config = checkpoint.arch_config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("MixtralForCausalLM", 2, 1)
    assert (config.moe_intermediate_size, config.norm_topk_prob, config.router_weights_float) == (32, True, True)
    weights = dict(checkpoint.iter_weights())
    gate_up = weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up, torch.from_numpy(np.concatenate([experts["blk.0.ffn_gate_exps.weight"],
                                                                 experts["blk.0.ffn_up_exps.weight"]], axis=1)))
    assert torch.equal(weights["model.layers.0.mlp.experts.down_proj"],
                       torch.from_numpy(experts["blk.0.ffn_down_exps.weight"]))
    (tmp_path / "experts.gguf").unlink()  # a file that says how its routing weights are normalized is believed
    assert not GGUFCheckpoint(_tiny_llama_experts(tmp_path, experts, weights_norm=False)).arch_config.norm_topk_prob
