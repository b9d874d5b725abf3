"""Decode-step roofline: time >= bytes / bandwidth (weights + live KV read once a step). The bandwidths are the
device-to-device copy rates measured on the lent machines (the device tool's KINDS.md): H200 4.27 TB/s (4.3
measured), H100 3.0 TB/s."""
from __future__ import annotations

from collections.abc import Sequence

from dflash2.config import ModelArchConfig

H200_BYTES_PER_S = 4.27e12
H100_BYTES_PER_S = 3.0e12


def device_bytes_per_s() -> float:
    """The roofline bandwidth of the CUDA device in use (the H200's where it is not an H100)."""
    import torch

    return H100_BYTES_PER_S if "H100" in torch.cuda.get_device_name() else H200_BYTES_PER_S


def moe_step_weight_bytes(arch: ModelArchConfig, experts_per_layer: int, element_bytes: int = 2) -> int:
    """Weight bytes one decode step of a mixture of experts reads when each sparse layer runs `experts_per_layer`
    distinct experts (k at batch 1): attention, router, the selected experts (and a shared expert, and the dense
    layers' MLP), the output projection."""
    h, layers = arch.hidden_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    total = layers * (h * (q + 2 * kv) + q * h) + arch.vocab_size * h
    for layer in range(layers):
        if arch.is_sparse_layer(layer):
            total += arch.num_experts * h + min(experts_per_layer, arch.num_experts) * 3 * h * arch.moe_intermediate_size
            if arch.shared_expert_intermediate_size:
                total += 3 * h * arch.shared_expert_intermediate_size + h
        else:
            total += 3 * h * arch.intermediate_size
    return total * element_bytes


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
