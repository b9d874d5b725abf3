"""Tiny random Hugging Face models written to disk, for comparing our engine with transformers."""
from __future__ import annotations

import os
import random

import torch

ARCHS = ("llama", "llama3-rope", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def hf_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    # Mixtures of experts: 8 experts, 2 or 3 a token; every router rule the families have (renormalized or not,
    # weights kept in float32 or not), a shared expert, a dense layer among sparse ones, clipped qkv
    moe = dict(common, num_experts_per_tok=2, intermediate_size=32)
    if arch == "mixtral":
        return tf.MixtralConfig(**moe, num_local_experts=8, sliding_window=None)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**moe, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 norm_topk_prob=False, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**dict(moe, num_experts_per_tok=3, intermediate_size=48), num_experts=8,
                                 moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
                                 tie_word_embeddings=False)
    if arch == "olmoe":
        return tf.OlmoeConfig(**moe, num_experts=8, norm_topk_prob=False, clip_qkv=1.5)
    raise ValueError(arch)


def build_tiny_model(arch: str, directory: str, seed: int = 0, **overrides):
    """Save a random model of this family to `directory`; returns the transformers model (float32, eval).
    `overrides` replace fields of the family's config."""
    from transformers import AutoModelForCausalLM

    config = hf_config(arch)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # random norm weights and biases too, so a wrong mapping cannot hide behind ones/zeros
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif name.endswith(("gate.weight", "experts.gate_up_proj", "experts.down_proj")):  # the router and
                param.copy_(0.3 * torch.randn_like(param))  # experts: spread, so top-k choices differ by token
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="200KB")  # several shards
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of the sequence: [len, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def random_prompts(count: int, seed: int, min_len: int = 3, max_len: int = 23) -> list[list[int]]:
    """`count` prompts of random token ids in 3..255, each of min_len..max_len - 1 tokens, from a seeded RNG."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(min_len, max_len))] for _ in range(count)]

