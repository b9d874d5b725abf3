"""Token embeddings, float or quantized. Either can also serve as the tied output projection (`project`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.layers.linear import float_matmul
from dflash2.layers.quant_linear import QuantLinear
from dflash2.quantization.formats import WeightFormat, dequantize_rows


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
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

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.fmt, self.packed().tensors, token_ids, self.out_dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)


def make_embedding(num_embeddings: int, embedding_dim: int, fmt: WeightFormat | None) -> nn.Module:
    if fmt is None:
        return Embedding(num_embeddings, embedding_dim)
    return QuantEmbedding(num_embeddings, embedding_dim, fmt)
