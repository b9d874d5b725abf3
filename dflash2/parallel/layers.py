"""The tensor-parallel wrappers parallel/shard.py puts around a rank's slices of the model's own layers.

    RowParallel               o_proj, a dense MLP's down_proj: a slice of the input features; partial products
                              summed over the tensor group (a bias added once, after the sum)
    ReducedOutput             a sparse MLP: each rank's experts and shared expert hold a slice of the intermediate
                              features, so the block's output is a partial sum: one all-reduce after both
    VocabParallelEmbedding    a slice of the vocabulary's rows: ids outside it give zero rows, summed over the
                              group (exact: one rank's row plus zeros); as the tied output projection, each rank's
                              logits for its slice, gathered
    VocabParallelHead         an untied lm_head on a slice of the vocabulary: logits gathered
    WholeHeadsNorm            OLMoE's q/k RMSNorm over all heads at once, on a rank holding some of them: the
                              sum of squares summed over the group

The column-parallel layers (qkv, gate_up, the experts' gate_up) need no wrapper: their output features are just
this rank's heads (or intermediate features), and the next layer takes them as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.layers.embedding import resolve_placeholders
from dflash2.parallel.groups import RankGroups


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, groups: RankGroups) -> None:
        super().__init__()
        self.inner = inner
        self.groups = groups
        self.bias = inner.bias  # added after the sum, once
        inner.bias = None

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        y = self.groups.all_reduce(self.inner(x, **kwargs))
        return y if self.bias is None else y + self.bias


class ReducedOutput(nn.Module):
    def __init__(self, inner: nn.Module, groups: RankGroups) -> None:
        super().__init__()
        self.inner = inner
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(self.inner(x).contiguous())


class _VocabGather(nn.Module):
    """Logits of a vocabulary slice -> the whole vocabulary's, gathered over the tensor group. Slices are
    `shard_size` rows (the last one may be shorter: padded for the gather, cut after)."""

    def __init__(self, shard_size: int, vocab_size: int, groups: RankGroups) -> None:
        super().__init__()
        self.shard_size, self.vocab_size, self.groups = shard_size, vocab_size, groups

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        if local.shape[-1] < self.shard_size:
            local = F.pad(local, (0, self.shard_size - local.shape[-1]))
        logits = torch.cat(self.groups.all_gather(local), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size].contiguous()


class VocabParallelEmbedding(_VocabGather):
    def __init__(self, inner: nn.Module, start: int, end: int, shard_size: int, vocab_size: int,
                 groups: RankGroups) -> None:
        super().__init__(shard_size, vocab_size, groups)
        self.inner = inner
        self.start, self.end = start, end

    def forward(self, token_ids: torch.Tensor, future_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if future_tokens is not None:
            token_ids = resolve_placeholders(token_ids, future_tokens)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        rows = self.inner(local.masked_fill(outside, 0))
        rows = rows.masked_fill(outside[:, None], 0)
        return self.groups.all_reduce(rows.contiguous())

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.inner.project(hidden))


class VocabParallelHead(_VocabGather):
    def __init__(self, inner: nn.Module, shard_size: int, vocab_size: int, groups: RankGroups) -> None:
        super().__init__(shard_size, vocab_size, groups)
        self.inner = inner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.inner(hidden))


class WholeHeadsNorm(nn.Module):
    """RMSNorm over `full_size` features of which this rank holds `weight`'s; `replicas`: how many ranks hold each
    feature (KV heads replicated over ranks), so their sum of squares counts once."""

    def __init__(self, weight: torch.Tensor, eps: float, full_size: int, replicas: int, groups: RankGroups) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps, self.full_size, self.replicas, self.groups = eps, full_size, replicas, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        squares = self.groups.all_reduce(x32.pow(2).sum(-1, keepdim=True).contiguous())
        variance = squares / (self.full_size * self.replicas)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)
