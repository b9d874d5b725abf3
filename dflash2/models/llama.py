"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM.

The network runs on a flat batch of tokens from many requests; attention reads and writes the paged KV
cache through a backend chosen at load time. q/k/v and gate/up are fused into one matmul each.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.kernels.attention_metadata import AttentionMetadata
from dflash2.layers.norm import RMSNorm
from dflash2.layers.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids (no module-level "current batch")."""

    positions: torch.Tensor  # [num_tokens] long
    attention: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) page views
    attention_backend: object


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_weight = _empty(self.q_size + 2 * self.kv_size, arch.hidden_size)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if arch.attention_bias else None
        self.o_weight = _empty(arch.hidden_size, self.q_size)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(ctx.positions, q, k)
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        out = ctx.attention_backend.forward(q, k, v, k_cache, v_cache, ctx.attention, self.scale)
        return F.linear(out.reshape(num_tokens, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_weight = _empty(2 * arch.intermediate_size, arch.hidden_size)
        self.down_weight = _empty(arch.hidden_size, arch.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer_index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_weight = _empty(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head_weight = None if arch.tie_word_embeddings else _empty(arch.vocab_size, arch.hidden_size)
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions)

    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """token_ids [T] -> final hidden states [T, hidden]."""
        x = F.embedding(token_ids, self.embed_weight)
        for layer in self.layers:
            x = layer(x, self.rotary, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        return F.linear(hidden, weight).float()

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be filled."""
        rows_filled = {name: 0 for name, _ in self.named_parameters()}
        for hf_name, tensor in weights:
            target = self._locate(hf_name)
            if target is None:
                continue
            name, rows = target
            param = self.get_parameter(name)
            dest = param.data if rows is None else param.data[rows[0]:rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {hf_name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            dest.copy_(tensor)
            rows_filled[name] += dest.shape[0]
        missing = [name for name, _ in self.named_parameters() if rows_filled[name] != self.get_parameter(name).shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def _locate(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """Map a Hugging Face tensor name to (our parameter, row range within it) or None to skip it."""
        a = self.arch
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        if hf_name == "model.embed_tokens.weight":
            return "embed_weight", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            return (None if a.tie_word_embeddings else ("lm_head_weight", None))
        if not hf_name.startswith("model.layers."):
            return None
        index, rest = hf_name[len("model.layers."):].split(".", 1)
        prefix = f"layers.{index}."
        fused = {
            "self_attn.q_proj.weight": ("self_attn.qkv_weight", (0, q)),
            "self_attn.k_proj.weight": ("self_attn.qkv_weight", (q, q + kv)),
            "self_attn.v_proj.weight": ("self_attn.qkv_weight", (q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": ("self_attn.qkv_bias", (0, q)),
            "self_attn.k_proj.bias": ("self_attn.qkv_bias", (q, q + kv)),
            "self_attn.v_proj.bias": ("self_attn.qkv_bias", (q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": ("self_attn.o_weight", None),
            "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),
            "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
            "mlp.gate_proj.weight": ("mlp.gate_up_weight", (0, inter)),
            "mlp.up_proj.weight": ("mlp.gate_up_weight", (inter, 2 * inter)),
            "mlp.down_proj.weight": ("mlp.down_weight", None),
            "input_layernorm.weight": ("input_layernorm.weight", None),
            "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
        }
        if rest not in fused:
            return None
        name, rows = fused[rest]
        return prefix + name, rows
