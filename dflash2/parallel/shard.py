"""Cut a whole loaded model down to one rank's part, in place: slices of our own canonical tensors.

    pipeline (stage s of P)   layers [a_s, b_s) (the first stages take one more when P does not divide them); the
                              first stage keeps the embedding, the last the final norm and the head (and the
                              embedding when the head is tied to it)
    tensor (rank t of T)      qkv rows: this rank's q heads and KV heads (KV heads replicated when T > their count);
                              o_proj columns of its q heads (RowParallel); gate_up rows of its slice of the
                              intermediate features (gate part, then up part), down columns of that slice; every
                              expert likewise (the router replicated; ReducedOutput after experts + shared
                              expert); vocabulary rows of the embedding and the untied head

A quantized weight is sliced in its packed layout (quantization/formats.py): rows are whole rows of every packed
tensor; columns are byte columns of qweight and group columns of scales / zeros (int4, int6), which must fall on
group boundaries (a clear error otherwise); int8's per-row scales stay whole for a column slice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.engine.kv.layout import SCALE_BYTES, KVLayout
from dflash2.layers.quant_experts import QuantExperts
from dflash2.layers.quant_linear import QuantLinear
from dflash2.layers.rotary import RotaryEmbedding
from dflash2.models.llama import LlamaMLP
from dflash2.models.moe import SparseMoeBlock
from dflash2.parallel.config import ParallelConfig
from dflash2.parallel.groups import RankGroups
from dflash2.parallel.layers import (ReducedOutput, RowParallel, VocabParallelEmbedding, VocabParallelHead,
                                     WholeHeadsNorm)


@dataclass(frozen=True)
class ShardPlan:
    """Which part of the model one rank holds."""

    tp_size: int
    tp_rank: int
    heads: tuple[int, int]  # first q head, count
    kv_heads: tuple[int, int]  # first KV head, count
    layers: tuple[int, int]  # [first, end) of the model's layers
    vocab: tuple[int, int]  # [first, end) of the vocabulary's rows
    vocab_shard: int  # rows a full vocabulary slice has (the last may have fewer)

    @staticmethod
    def of(arch: ModelArchConfig, parallel: ParallelConfig, rank: int) -> "ShardPlan":
        check_fits(arch, parallel)
        tp, stage = parallel.tensor_parallel_size, rank // parallel.tensor_parallel_size
        tp_rank = rank % tp
        heads = arch.num_heads // tp
        if arch.num_kv_heads >= tp:
            kv = (tp_rank * (arch.num_kv_heads // tp), arch.num_kv_heads // tp)
        else:
            kv = (tp_rank * arch.num_kv_heads // tp, 1)
        shard = -(-arch.vocab_size // tp)
        vocab = (min(arch.vocab_size, tp_rank * shard), min(arch.vocab_size, (tp_rank + 1) * shard))
        return ShardPlan(tp, tp_rank, (tp_rank * heads, heads), kv,
                         stage_layers(arch.num_layers, parallel.pipeline_parallel_size, stage), vocab, shard)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Layers [first, end) of a pipeline stage: as even as can be, the first stages one more."""
    base, extra = divmod(num_layers, num_stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (stage < extra)


def check_fits(arch: ModelArchConfig, parallel: ParallelConfig) -> None:
    """ValueError naming the numbers where this model cannot be split so."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    flag = f"tensor_parallel_size {tp}"
    if arch.num_heads % tp:
        raise ValueError(f"{flag} does not divide the model's {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if kv >= tp and kv % tp:
        raise ValueError(f"{flag} does not divide the model's {kv} KV heads")
    if kv < tp and tp % kv:
        raise ValueError(f"{flag} is not a multiple of the model's {kv} KV heads (with fewer KV heads than ranks "
                         f"each KV head is replicated on tensor_parallel_size / KV heads ranks)")
    sizes = {"intermediate size": arch.intermediate_size if any(not arch.is_sparse_layer(i)
                                                               for i in range(arch.num_layers)) else 0,
             "experts' intermediate size": arch.moe_intermediate_size,
             "shared expert's intermediate size": arch.shared_expert_intermediate_size}
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(f"{flag} does not divide the model's {what} {size}")
    if arch.vocab_size < tp:
        raise ValueError(f"{flag} is more than the model's vocabulary of {arch.vocab_size}")
    if pp > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {arch.num_layers} layers")


def local_layout(full: KVLayout, plan: ShardPlan) -> KVLayout:
    """This rank's KV layout: its layers and KV heads, in a page of the bytes they take of the whole page, so that a
    page id holds the same tokens on every rank (equal tokens per page)."""
    part = dataclasses.replace(full, num_layers=plan.layers[1] - plan.layers[0], num_kv_heads=plan.kv_heads[1])
    page_bytes = full.tokens_per_page * part.bytes_per_token
    align = max(part.element_bytes, SCALE_BYTES)
    layout = dataclasses.replace(part, page_bytes=-(-page_bytes // align) * align)
    assert layout.tokens_per_page == full.tokens_per_page, (layout, full)
    return layout


def shard_model(module: nn.Module, arch: ModelArchConfig, groups: RankGroups) -> nn.Module:
    """Cut `module` (a whole LlamaForCausalLM) down to this rank's part, in place; returns it on the rank's device,
    its rotary tables computed there (derived, not weights: equal to what one process on that device computes)."""
    plan = ShardPlan.of(arch, groups.parallel, groups.rank)
    _keep_stage(module, plan, groups)
    if groups.world_size > 1:  # the residual add waits for the all-reduce; a stage ends with (x, residual) apart
        for layer in module.layers:
            layer.may_fuse_norms = False
    if plan.tp_size > 1:
        for offset, layer in enumerate(module.layers):
            where = f"layer {plan.layers[0] + offset}"
            _shard_attention(layer.self_attn, arch, plan, groups, where)
            _shard_mlp(layer, plan, groups, where)
        _shard_vocabulary(module, arch, plan, groups)
    max_positions = module.rotary.cos.shape[0]
    module = module.to(groups.device)
    with torch.device(groups.device):
        module.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions)
    return module


# -- pipeline ----------------------------------------------------------------------------------------
def _keep_stage(module: nn.Module, plan: ShardPlan, groups: RankGroups) -> None:
    first, end = plan.layers
    module.layers = nn.ModuleList(list(module.layers)[first:end])
    for index, layer in enumerate(module.layers):
        layer.self_attn.layer_index = index  # into this rank's own KV views
    tied = module.lm_head is None
    if not groups.is_first_stage and not (groups.is_last_stage and tied):
        module.embed_tokens = None
    if not groups.is_last_stage:
        module.norm = None
        module.lm_head = None


# -- tensor ------------------------------------------------------------------------------------------
def _shard_attention(attn: nn.Module, arch: ModelArchConfig, plan: ShardPlan, groups: RankGroups,
                     where: str) -> None:
    dim = arch.head_dim
    q_full, kv_full = arch.num_heads * dim, arch.num_kv_heads * dim
    (head, heads), (kv_head, kv_heads) = plan.heads, plan.kv_heads
    q = (head * dim, (head + heads) * dim)
    k = (q_full + kv_head * dim, q_full + (kv_head + kv_heads) * dim)
    v = (k[0] + kv_full, k[1] + kv_full)
    take_rows(attn.qkv_proj, [q, k, v])
    take_columns(attn.o_proj, *q, f"{where} o_proj")
    attn.o_proj = RowParallel(attn.o_proj, groups)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * dim, kv_heads * dim
    if attn.qk_norm_whole:  # OLMoE: normed over all heads at once
        replicas = max(1, plan.tp_size // arch.num_kv_heads)
        attn.q_norm = WholeHeadsNorm(attn.q_norm.weight[q[0]:q[1]], attn.q_norm.eps, q_full, 1, groups)
        kv_cols = (kv_head * dim, (kv_head + kv_heads) * dim)
        attn.k_norm = WholeHeadsNorm(attn.k_norm.weight[kv_cols[0]:kv_cols[1]], attn.k_norm.eps, kv_full,
                                     replicas, groups)


def _shard_mlp(layer: nn.Module, plan: ShardPlan, groups: RankGroups, where: str) -> None:
    mlp = layer.mlp
    if isinstance(mlp, LlamaMLP):
        _shard_dense_mlp(mlp, plan, where)
        mlp.down_proj = RowParallel(mlp.down_proj, groups)
        return
    assert isinstance(mlp, SparseMoeBlock), type(mlp)
    shard_experts(mlp.experts, plan, where)
    if mlp.shared_expert is not None:  # its partial output joins the experts' before the one all-reduce
        _shard_dense_mlp(mlp.shared_expert, plan, f"{where} shared expert")
    layer.mlp = ReducedOutput(mlp, groups)


def _slice(size: int, plan: ShardPlan) -> tuple[int, int]:
    part = size // plan.tp_size
    return plan.tp_rank * part, (plan.tp_rank + 1) * part


def _shard_dense_mlp(mlp: LlamaMLP, plan: ShardPlan, where: str) -> None:
    inter = mlp.intermediate_size
    first, end = _slice(inter, plan)
    take_rows(mlp.gate_up_proj, [(first, end), (inter + first, inter + end)])
    take_columns(mlp.down_proj, first, end, f"{where} down_proj")
    mlp.intermediate_size = end - first


def shard_experts(experts: nn.Module, plan: ShardPlan, where: str) -> None:
    """Every expert's slice of the intermediate features: gate_up [E, 2I, H] rows, down [E, H, I] columns."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if isinstance(gate_up, QuantExperts):
        inter = gate_up.out_features // 2
        first, end = _slice(inter, plan)
        _take_packed_rows(gate_up, [(first, end), (inter + first, inter + end)], dim=1)
        gate_up.out_features = 2 * (end - first)
        _take_packed_columns(down, first, end, f"{where} experts' down_proj", leading=1)
        down.in_features = end - first
        return
    inter = gate_up.shape[1] // 2
    first, end = _slice(inter, plan)
    experts.gate_up_proj = _parameter(torch.cat([gate_up[:, first:end], gate_up[:, inter + first:inter + end]], 1))
    experts.down_proj = _parameter(down[:, :, first:end])


def _shard_vocabulary(module: nn.Module, arch: ModelArchConfig, plan: ShardPlan, groups: RankGroups) -> None:
    first, end = plan.vocab
    if module.embed_tokens is not None:
        embed = module.embed_tokens
        if isinstance(embed, QuantLinear):  # QuantEmbedding: rows are the vocabulary
            take_rows(embed, [(first, end)])
        else:
            embed.weight = _parameter(embed.weight[first:end])
        module.embed_tokens = VocabParallelEmbedding(embed, first, end, plan.vocab_shard, arch.vocab_size, groups)
    if module.lm_head is not None:
        take_rows(module.lm_head, [(first, end)])
        module.lm_head = VocabParallelHead(module.lm_head, plan.vocab_shard, arch.vocab_size, groups)


# -- slicing one layer's tensors ---------------------------------------------------------------------
def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous().clone(), requires_grad=False)


def take_rows(layer: nn.Module, parts: list[tuple[int, int]]) -> None:
    """Keep these ranges of a Linear's / QuantLinear's output features (and bias), concatenated in order."""
    count = sum(end - first for first, end in parts)
    if isinstance(layer, QuantLinear):
        _take_packed_rows(layer, parts, dim=0)
    else:
        layer.weight = _parameter(torch.cat([layer.weight[first:end] for first, end in parts]))
    if layer.bias is not None:
        layer.bias = _parameter(torch.cat([layer.bias[first:end] for first, end in parts]))
    layer.out_features = count


def take_columns(layer: nn.Module, first: int, end: int, where: str) -> None:
    """Keep input features [first, end) of a Linear / QuantLinear (the bias is whole: RowParallel adds it once)."""
    if isinstance(layer, QuantLinear):
        _take_packed_columns(layer, first, end, where, leading=0)
    else:
        layer.weight = _parameter(layer.weight[:, first:end])
    layer.in_features = end - first


def _take_packed_rows(layer: nn.Module, parts: list[tuple[int, int]], dim: int) -> None:
    for name in layer.tensor_names:
        tensor = getattr(layer, name)
        pieces = [tensor.narrow(dim, first, end - first) for first, end in parts]
        setattr(layer, name, torch.cat(pieces, dim).contiguous())
    _forget_runtime(layer)


def _take_packed_columns(layer: nn.Module, first: int, end: int, where: str, leading: int) -> None:
    """Input features [first, end) of a packed weight; `leading`: dimensions before the [N, ...] matrix (experts)."""
    fmt = layer.fmt
    column_dim = leading + 1
    if fmt.grouped and (first % fmt.group_size or end % fmt.group_size):
        raise ValueError(f"{where}: tensor parallelism would split its {layer.in_features} input features at "
                         f"{first}..{end}, cutting an int{fmt.bits} group of {fmt.group_size}; convert with a group "
                         f"size dividing {end - first}, or choose another tensor_parallel_size")
    for name in layer.tensor_names:
        tensor = getattr(layer, name)
        if name in ("weight", "qweight"):
            scale = {16: (1, 1), 8: (1, 1), 4: (1, 2), 6: (3, 4)}[fmt.bits]  # stored elements per feature
            lo, hi = first * scale[0] // scale[1], end * scale[0] // scale[1]
        elif fmt.grouped:  # scales and zeros: one column a group
            lo, hi = first // fmt.group_size, end // fmt.group_size
        else:  # int8's per-row scales
            continue
        setattr(layer, name, tensor.narrow(column_dim, lo, hi - lo).contiguous().clone())
    _forget_runtime(layer)


def _forget_runtime(layer: nn.Module) -> None:
    if isinstance(layer, QuantLinear):
        layer.runtime = None
    elif isinstance(layer, QuantExperts):
        layer.runtimes = None
