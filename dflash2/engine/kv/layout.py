"""KVLayout: how one model's K and V fill a page of the shared byte pool.

    page (page_bytes bytes):  [ layer 0: K[t, kv_head, dim] V[...] | layer 1: K V | ... | unused tail ]

A model with a smaller KV dtype or fewer heads fits more tokens in the same page, and models of
different layouts share one pool and one free list (DESIGN.md decision 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.config import ModelArchConfig

KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; supported now: auto, "
                         f"{', '.join(sorted(KV_DTYPES))} (quantized KV comes with the quantization work)")
    return KV_DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_bytes: int

    @staticmethod
    def for_model(arch: ModelArchConfig, dtype: torch.dtype, page_bytes: int) -> "KVLayout":
        layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype, page_bytes)
        if layout.tokens_per_page < 1:
            raise ValueError(f"page_bytes {page_bytes} is smaller than one token's KV "
                             f"({layout.bytes_per_token} bytes); raise page_bytes")
        return layout

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def tokens_per_page(self) -> int:
        return self.page_bytes // self.bytes_per_token

    def layer_views(self, pool_bytes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Typed (K, V) views of the byte pool for each layer, each [num_pages, tokens_per_page, heads, dim]."""
        num_pages = pool_bytes.numel() // self.page_bytes
        used = self.tokens_per_page * self.bytes_per_token
        pages = pool_bytes[: num_pages * self.page_bytes].view(num_pages, self.page_bytes)[:, :used]
        typed = pages.view(self.dtype).view(
            num_pages, self.num_layers, 2, self.tokens_per_page, self.num_kv_heads, self.head_dim)
        return [(typed[:, layer, 0], typed[:, layer, 1]) for layer in range(self.num_layers)]
