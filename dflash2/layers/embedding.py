"""Token embeddings, float or quantized. Either can also serve as the tied output projection (`project`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.layers.linear import float_matmul
from dflash2.layers.quant_linear import QuantLinear
from dflash2.quantization.formats import WeightFormat, dequantize_rows


def resolve_placeholders(token_ids: torch.Tensor, future_tokens: torch.Tensor) -> torch.Tensor:
    """token_ids with each placeholder -(i + 1) replaced by the token the previous step left in future slot i
    (one Triton launch on CUDA: kernels/triton/step_edges.py)."""
    if token_ids.is_cuda:
        from dflash2.kernels.triton.step_edges import resolve_tokens

        return resolve_tokens(token_ids, future_tokens)
    return torch.where(token_ids < 0, future_tokens[(-token_ids - 1).clamp(min=0)], token_ids)


def graph_lookup(table: torch.Tensor | None, token_ids: torch.Tensor, dtype: torch.dtype,
                 future_tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A step graph's lookup: (rows, ids). Where the table is 16-bit on CUDA, the rows from one launch that also
    resolves the placeholders; else None and the ids with the placeholders resolved, for the caller's own lookup."""
    if table is not None and table.is_cuda and table.element_size() == 2 and table.stride(1) == 1:
        from dflash2.kernels.triton.step_edges import embed_tokens

        return embed_tokens(token_ids, table, dtype, future_tokens), token_ids
    return None, resolve_placeholders(token_ids, future_tokens)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, token_ids: torch.Tensor, future_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for token_ids; with future_tokens, placeholders -(i + 1) are first resolved from it."""
        if future_tokens is not None:
            rows, token_ids = graph_lookup(self.weight, token_ids, self.weight.dtype, future_tokens)
            if rows is not None:
                return rows
        return F.embedding(token_ids, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return float_matmul(hidden, self.weight)


class QuantEmbedding(QuantLinear):
    """Rows are vocabulary entries: int8 scales are per token, int4/int6 groups run along the hidden size.

    A lookup dequantizes only the rows asked for, from the on-disk layout (kept after `prepare`);
    `project` is the quantized matmul, for a tied output projection.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: WeightFormat) -> None:
        super().__init__(embedding_dim, num_embeddings, fmt)
        self.out_dtype = torch.get_default_dtype()

    def forward(self, token_ids: torch.Tensor, future_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for token_ids; with future_tokens, placeholders -(i + 1) are first resolved from it."""
        if future_tokens is not None:
            table = self.weight if self.fmt.bits == 16 else None
            rows, token_ids = graph_lookup(table, token_ids, self.out_dtype, future_tokens)
            if rows is not None:
                return rows
        return dequantize_rows(self.fmt, self.packed().tensors, token_ids, self.out_dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)


def make_embedding(num_embeddings: int, embedding_dim: int, fmt: WeightFormat | None) -> nn.Module:
    if fmt is None:
        return Embedding(num_embeddings, embedding_dim)
    return QuantEmbedding(num_embeddings, embedding_dim, fmt)
