"""Architecture name -> model class, and the named presets for `load_format="dummy"`."""
from __future__ import annotations

from torch import nn

from dflash2.config import SUPPORTED_ARCHITECTURES, ModelArchConfig, RopeConfig
from dflash2.models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_MODEL_CLASSES)}")
    return _MODEL_CLASSES[architecture]


PRESETS: dict[str, ModelArchConfig] = {
    "smollm2-135m": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0), tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    "qwen3-0.6b": ModelArchConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True, qk_norm=True,
        eos_token_ids=(151645,)),
    "llama-3.2-1b": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0,
                                           original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama-3-8b": ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0), bos_token_id=128000, eos_token_ids=(128001,)),
    # mixtures of experts (issue 45): the published configs' numbers
    "qwen3-30b-a3b": ModelArchConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), qk_norm=True, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, eos_token_ids=(151645,)),
    "mixtral-8x7b": ModelArchConfig(
        architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=1000000.0), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True, router_weights_float=True, bos_token_id=1,
        eos_token_ids=(2,)),
    "olmoe-1b-7b": ModelArchConfig(
        architecture="OlmoeForCausalLM", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0), qk_norm_whole=True, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=1024, eos_token_ids=(50279,)),
    "qwen1.5-moe-a2.7b": ModelArchConfig(
        architecture="Qwen2MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), attention_bias=True, num_experts=60,
        num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        eos_token_ids=(151643,)),
}


def preset(name: str) -> ModelArchConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown architecture preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
