"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM, and the mixtures of
experts built on it: Mixtral, Qwen2-MoE (qkv bias, a shared expert), Qwen3-MoE (q/k norm), OLMoE (q/k norm over
all heads, clipped qkv); their sparse layers' MLP is models/moe.py's SparseMoeBlock.

The network runs on a flat batch of tokens from many requests; attention reads and writes the paged KV
cache through a backend chosen at load time. q/k/v and gate/up are fused into one matmul each.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.kernels.attention_metadata import AttentionMetadata
from dflash2.layers.embedding import make_embedding
from dflash2.layers.linear import make_linear
from dflash2.layers.norm import RMSNorm
from dflash2.layers.quant_linear import QuantLinear
from dflash2.layers.rotary import RotaryEmbedding, rotate
from dflash2.models.moe import SparseMoeBlock
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.formats import WeightFormat


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids (no module-level "current batch")."""

    positions: torch.Tensor  # [num_tokens] long
    attention: AttentionMetadata
    kv_caches: list  # per layer: a KVCache (K/V page views and scales), or what the backend takes
    attention_backend: object
    step_values: dict = field(default_factory=dict)  # what every layer derives alike, filled by the first

    def begin_forward(self) -> None:
        """Drop the previous forward's step values (a step graph's context and metadata serve every replay)."""
        self.step_values.clear()
        if self.attention is not None:
            self.attention.step_values.clear()


def _format(quant: QuantConfig | None, group: str, in_features: int, layer: int | None = None) -> WeightFormat | None:
    """The weight format of one layer's tensor group; None (float, the model dtype) for a plain checkpoint."""
    return None if quant is None else quant.format_for(group, in_features, layer)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                    _format(quant, "qkv", arch.hidden_size, layer_index), bias=arch.attention_bias)
        self.o_proj = make_linear(self.q_size, arch.hidden_size, _format(quant, "o_proj", self.q_size, layer_index))
        self.qk_norm_whole = arch.qk_norm_whole  # over all heads at once (OLMoE), else per head (Qwen3)
        q_dim, k_dim = (self.q_size, self.kv_size) if arch.qk_norm_whole else (self.head_dim, self.head_dim)
        has_norm = arch.qk_norm or arch.qk_norm_whole
        self.q_norm = RMSNorm(q_dim, arch.rms_norm_eps) if has_norm else None
        self.k_norm = RMSNorm(k_dim, arch.rms_norm_eps) if has_norm else None
        self.clip_qkv = arch.clip_qkv
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext, norm: RMSNorm | None = None,
                add_to: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of x; with `norm`, of norm(x), and with `add_to`, added into that tensor (both folded into
        the qkv and o_proj GEMVs: LlamaDecoderLayer.fuses_norms)."""
        qkv = self.qkv_proj(x) if norm is None else self.qkv_proj(x, norm=norm)
        out = self._rotate_and_attend(qkv, rotary, ctx).reshape(x.shape[0], self.q_size)
        return self.o_proj(out) if add_to is None else self.o_proj(out, add_to=add_to)

    def _rotate_and_attend(self, qkv: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        """Attention of the qkv output: Qwen3's q/k norms and the rotary applied (by the backend while it writes
        the cache where it can), k and v written, q attending."""
        num_tokens = qkv.shape[0]
        cache = ctx.kv_caches[self.layer_index]
        backend = ctx.attention_backend
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:  # OLMoE: normed, then clipped
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        fused = q.is_cuda and getattr(backend, "fuses_rotary", False)  # rotary applied while writing the cache
        qk_norm = None
        if self.q_norm is not None and not self.qk_norm_whole:
            if fused:  # Qwen3's q/k norms in the same launch
                qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            elif q.is_cuda and self.head_dim & (self.head_dim - 1) == 0:
                from dflash2.kernels.triton.elementwise import qk_rms_norm_

                qk_rms_norm_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # in the qkv output
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if fused:
            return backend.forward_rotary(q, k, v, cache, ctx.attention, self.scale, rotary.cos, rotary.sin, qk_norm)
        if q.is_cuda:
            q, k = rotary(ctx.positions, q, k)
            return backend.forward(q, k, v, cache, ctx.attention, self.scale)
        rows = ctx.step_values.get("rotary")  # cos/sin rows: the same for every layer
        if rows is None:
            rows = ctx.step_values["rotary"] = rotary.rows(ctx.positions, q.dtype)
        if self.q_norm is None and self.clip_qkv is None:  # q and k side by side in qkv's rows: one rotation
            heads = self.num_heads + self.num_kv_heads
            qk = rotate(qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim), rows)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q, k = rotate(q, rows), rotate(k, rows)
        return backend.forward(q, k, v, cache, ctx.attention, self.scale)

    @property
    def qkv_weight(self) -> torch.Tensor:  # the fused float weight of a plain checkpoint (tests read it)
        return self.qkv_proj.weight

    @property
    def qkv_bias(self) -> torch.Tensor | None:
        return self.qkv_proj.bias


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int, quant: QuantConfig | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or arch.intermediate_size
        hidden, inter = arch.hidden_size, self.intermediate_size
        self.gate_up_proj = make_linear(hidden, 2 * inter, _format(quant, "ffn", hidden, layer_index))
        self.down_proj = make_linear(inter, hidden, _format(quant, "ffn", inter, layer_index))
        if isinstance(self.gate_up_proj, QuantLinear):
            self.gate_up_proj.gate_up = True

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, add_to: torch.Tensor | None = None) -> torch.Tensor:
        # silu(gate) * up: applied by gate_up_proj as it stores its outputs where its kernel can (the int4
        # GEMV; a float weight's skinny GEMM at 2-16 rows), else by down_proj on its input (fused into the 16-bit
        # GEMV at one row)
        if norm is not None or add_to is not None:  # LlamaDecoderLayer.fuses_norms: gate_up norms, down adds
            if getattr(self.gate_up_proj, "fuses_silu_out", False):  # the int4 GEMV: silu(gate) * up comes out
                return self.down_proj(self.gate_up_proj(x, silu_out=True, norm=norm), add_to=add_to)
            return self.down_proj(self.gate_up_proj(x, norm=norm), silu_mul=True, add_to=add_to)
        if self.gate_up_proj.fuses_silu_out_for(x):
            return self.down_proj(self.gate_up_proj(x, silu_out=True))
        return self.down_proj(self.gate_up_proj(x), silu_mul=True)  # silu(gate) * up, fused where it can be


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer_index, quant)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.is_sparse_layer(layer_index):
            shared = arch.shared_expert_intermediate_size
            formats = (_format(quant, "experts", arch.hidden_size, layer_index),
                       _format(quant, "experts", arch.moe_intermediate_size, layer_index))
            self.mlp = SparseMoeBlock(arch, layer_index, LlamaMLP(arch, layer_index, quant, shared) if shared else None,
                                      formats)
        else:
            self.mlp = LlamaMLP(arch, layer_index, quant)
        # off where an all-reduce must come between a projection and the residual add (parallel/shard.py)
        self.may_fuse_norms = True

    def fuses_norms(self, rows: int) -> bool:
        """Whether this layer's kernels take its norms and residual adds for `rows` tokens: qkv and gate_up (a
        sparse layer: the router) norm their input, o_proj and down (the experts' down kernel) add their output
        into the residual stream (Linear / QuantLinear.fuses_norm: the int4 and 16-bit GEMVs; SparseMoeBlock.
        fuses_norm)."""
        if not self.may_fuse_norms:
            return False
        attention = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        if not all(linear.fuses_norm(rows) for linear in attention):
            return False
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.fuses_norm(rows)
        gate_up, down = self.mlp.gate_up_proj, self.mlp.down_proj
        # int4 gate_up hands silu(gate) * up to down; a 16-bit one [gate | up], which the 16-bit down GEMV takes
        return (gate_up.fuses_norm(rows) and down.fuses_norm(rows)
                and (getattr(gate_up, "fuses_silu_out", False) or not isinstance(down, QuantLinear)
                     or down.fmt.bits == 16))

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): the add is fused into
        the next norm. Where fuses_norms: (None, the residual stream with everything added), its GEMVs having
        normed and added; x None: nothing is left to add."""
        if self.fuses_norms(residual.shape[0] if x is None else x.shape[0]):
            if residual is None:
                residual = x
            elif x is not None:
                residual.add_(x)
            self.self_attn(residual, rotary, ctx, norm=self.input_layernorm, add_to=residual)
            self.mlp(residual, norm=self.post_attention_layernorm, add_to=residual)
            return None, residual
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        elif x is None:
            h = self.input_layernorm(residual)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """`quant` None: float weights in the model dtype. Otherwise each layer's tensors in their own format;
    a tied output projection shares the embedding unless the two formats differ."""

    def __init__(self, arch: ModelArchConfig, max_positions: int, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.arch, self.quant = arch, quant
        hidden, vocab = arch.hidden_size, arch.vocab_size
        embed_format = _format(quant, "embed", hidden)
        head_format = _format(quant, "lm_head", hidden)
        self.embed_tokens = make_embedding(vocab, hidden, embed_format)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, quant) for i in range(arch.num_layers))
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        tied = arch.tie_word_embeddings and head_format == embed_format
        self.lm_head = None if tied else make_linear(hidden, vocab, head_format)
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions)

    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext,
                future_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T] -> final hidden states [T, hidden]. With future_tokens, a placeholder id -(i + 1) stands
        for future_tokens[i] (a step graph's ids: resolved in the embedding's launch where it can)."""
        x = self.embed_tokens(token_ids, future_tokens)
        ctx.begin_forward()
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, ctx)
        return self.norm(residual) if x is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype, as the reference computes them; consumers that do arithmetic on them
        (temperature, penalties, log-softmax) cast to float32 first, which is exact."""
        head = self.embed_tokens.project if self.lm_head is None else self.lm_head
        return head(hidden)

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter and buffer from (name, tensor) pairs; each must be filled exactly once.

        A name may be our own (a converted checkpoint: `layers.0.self_attn.qkv_proj.qweight`, packed
        tensors copied as they are) or a Hugging Face name, whose rows go into the fused float layers.
        """
        targets = self.state_dict(keep_vars=True)
        filled = dict.fromkeys(targets, 0)  # elements
        for name, tensor in weights:
            located = (name, None) if name in targets else self._locate(name)
            if located is None:
                continue
            target, part = located
            if target not in targets:
                raise ValueError(f"weight {name}: this model has no {target} (a float weight for a quantized "
                                 f"layer? convert the checkpoint with `dflash2 convert`)")
            dest = targets[target].data
            if part is not None:  # (first row, end row), or (expert, first row, end row) of stacked experts
                dest = dest[part[0]:part[1]] if len(part) == 2 else dest[part[0]][part[1]:part[2]]
            _check_tensor(name, dest, tensor)
            dest.copy_(tensor)
            filled[target] += dest.numel()
        missing = [n for n, t in targets.items() if filled[n] != t.numel()]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def _locate(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """Map a Hugging Face tensor name to (our parameter, row range within it) or None to skip it. A packed
        tensor of a quantized weight (`<weight name minus .weight>.qweight` / `.scales` / `.zeros`: the GGUF
        loader's native path) goes where that weight would, to the quantized layer's buffer of that name."""
        base, _, suffix = hf_name.rpartition(".")
        if suffix in ("qweight", "scales", "zeros"):
            located = self._locate(f"{base}.weight")
            return None if located is None else (f"{located[0].rsplit('.', 1)[0]}.{suffix}", located[1])
        a = self.arch
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            return None if self.lm_head is None else ("lm_head.weight", None)
        if not hf_name.startswith("model.layers."):
            return None
        index, rest = hf_name[len("model.layers."):].split(".", 1)
        prefix = f"layers.{index}."
        fused = {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", (0, q)),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", (q, q + kv)),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", (q + kv, q + 2 * kv)),
            "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", (0, q)),
            "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", (q, q + kv)),
            "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", (q + kv, q + 2 * kv)),
            "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
            "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),
            "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", (0, inter)),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", (inter, 2 * inter)),
            "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
            "input_layernorm.weight": ("input_layernorm.weight", None),
            "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
        }
        if rest in fused:
            name, rows = fused[rest]
            return prefix + name, rows
        return _locate_moe(rest, prefix, a)


def _locate_moe(rest: str, prefix: str, arch: ModelArchConfig) -> tuple[str, tuple[int, ...] | None] | None:
    """A mixture-of-experts tensor of one layer (its name after `model.layers.N.`): the router, one expert's
    projection (into the stacked experts: (expert, rows)), the stacked experts as transformers 5 holds them, or
    Qwen2-MoE's shared expert and its gate."""
    if not arch.num_experts:
        return None
    inter, shared = arch.moe_intermediate_size, arch.shared_expert_intermediate_size
    block, _, rest = rest.partition(".")  # Mixtral: block_sparse_moe.*, the others: mlp.*
    if block not in ("mlp", "block_sparse_moe"):
        return None
    if rest == "gate.weight":
        return prefix + "mlp.gate.weight", None
    if rest in ("experts.gate_up_proj", "experts.down_proj"):
        return prefix + "mlp." + rest, None
    if rest == "shared_expert_gate.weight":
        return prefix + "mlp.shared_expert_gate.weight", None
    shared_parts = {"gate_proj": ("gate_up_proj", (0, shared)), "up_proj": ("gate_up_proj", (shared, 2 * shared)),
                    "down_proj": ("down_proj", None)}
    if rest.startswith("shared_expert.") and rest.endswith(".weight"):
        projection = rest[len("shared_expert."):-len(".weight")]
        if projection in shared_parts:
            name, rows = shared_parts[projection]
            return f"{prefix}mlp.shared_expert.{name}.weight", rows
        return None
    if not rest.startswith("experts.") or not rest.endswith(".weight"):
        return None
    index, _, projection = rest[len("experts."):-len(".weight")].partition(".")
    expert_parts = {"gate_proj": ("gate_up_proj", (0, inter)), "w1": ("gate_up_proj", (0, inter)),
                    "up_proj": ("gate_up_proj", (inter, 2 * inter)), "w3": ("gate_up_proj", (inter, 2 * inter)),
                    "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
    if not index.isdigit() or projection not in expert_parts:
        return None
    name, rows = expert_parts[projection]
    expert = int(index)
    return f"{prefix}mlp.experts.{name}", (expert, *(rows or (0, inter if name == "gate_up_proj" else arch.hidden_size)))


def _check_tensor(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
    if not dest.is_floating_point() and tensor.dtype != dest.dtype:
        raise ValueError(f"weight {name}: expected dtype {dest.dtype}, got {tensor.dtype}")
