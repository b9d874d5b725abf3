"""Decode-step roofline on the H200: time >= bytes / 4.27 TB/s (weights + live KV read once a step)."""
from __future__ import annotations

from collections.abc import Sequence

from dflash2.config import ModelArchConfig

H200_BYTES_PER_S = 4.27e12


def weight_bytes(arch: ModelArchConfig, element_bytes: int = 2) -> int:
    h, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    lm_head = arch.vocab_size * h  # read every step; a tied embedding is read through lm_head only
    return (layers * per_layer + lm_head) * element_bytes


def decode_ceiling_tok_s(arch: ModelArchConfig, prompt_lens: Sequence[int], new_tokens: int,
                         kv_element_bytes: int = 2, weight_element_bytes: int = 2) -> float:
    """Output tok/s if every request decodes together and each step streams weights + all live KV."""
    kv_per_token = arch.kv_bytes_per_token(kv_element_bytes)
    weights = weight_bytes(arch, weight_element_bytes)
    total_prompt = sum(prompt_lens)
    num = len(prompt_lens)
    # step i (0-based) reads prompt + i tokens of KV per request
    kv_bytes = kv_per_token * (new_tokens * total_prompt + num * new_tokens * (new_tokens - 1) // 2)
    seconds = (new_tokens * weights + kv_bytes) / H200_BYTES_PER_S
    return num * new_tokens / seconds
