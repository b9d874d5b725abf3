"""KVLayout: how one model's K and V fill a page of the shared byte pool.

    page (page_bytes bytes):
    [ data: L0 K | L0 V | L1 K | L1 V | ... | scales: L0 K | L0 V | L1 K | ... | unused tail ]
      data block (head-major):  [kv_head][token][head_dim]   values of the KV dtype
                                int4: [kv_head][token][head_dim / 2] bytes, two values a byte
      scale block (quantized):  [kv_head][token]              fp16, one scale per token and head

Head-major keeps one head's tokens of a page contiguous (tokens_per_page * row bytes), so a decode
program that reads one KV head streams whole runs of memory instead of one row per token; the older
token-major order ([token][kv_head][dim]) stays available (`head_major=False`) to measure against.
Either way the typed views have the logical shape [num_pages, tokens_per_page, kv_heads, row] (strides
differ), so the attention backends index them the same way.

Quantized KV (int8, int4, fp8) is symmetric with one fp16 scale per token and head:
scale = absmax / qmax (127, 7, 448), value = round(x / scale). Everything a token needs is inside the
page, so host swap and prefix sharing, which copy whole byte pages, work unchanged. A model with a smaller
KV dtype or fewer heads fits more tokens in the same page, and models of different layouts share one pool
and one free list (DESIGN.md decision 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.config import ModelArchConfig
from dflash2.kernels.attention_metadata import KVCache

SCALE_DTYPE = torch.float16
SCALE_BYTES = 2


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype  # element type of the data views
    values_per_element: int = 1  # int4: two values a byte
    quantized: bool = False


KV_FORMATS = {
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
    "fp32": KVFormat("fp32", torch.float32),
    "int8": KVFormat("int8", torch.int8, quantized=True),
    "int4": KVFormat("int4", torch.uint8, values_per_element=2, quantized=True),
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, quantized=True),
}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
_FROM_TORCH = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kv_dtype_name(value: str | torch.dtype) -> str:
    """'bfloat16' / torch.bfloat16 -> 'bf16'; ValueError naming the supported KV dtypes otherwise."""
    if isinstance(value, torch.dtype):
        if value not in _FROM_TORCH:
            raise ValueError(f"no KV cache format for model dtype {value}")
        return _FROM_TORCH[value]
    name = _ALIASES.get(value.strip().lower(), value.strip().lower())
    if name not in KV_FORMATS:
        raise ValueError(f"unsupported kv_cache_dtype {value!r}; supported: auto, {', '.join(KV_FORMATS)}")
    return name


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, checkpoint_kv_dtype: str | None = None) -> str:
    """The KV format name: an explicit choice wins; "auto" takes a converted checkpoint's recorded choice,
    else the model dtype."""
    if kv_cache_dtype != "auto":
        return kv_dtype_name(kv_cache_dtype)
    if checkpoint_kv_dtype not in (None, "auto"):
        return kv_dtype_name(checkpoint_kv_dtype)
    return kv_dtype_name(model_dtype)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # a KV_FORMATS name
    page_bytes: int
    head_major: bool = True

    @staticmethod
    def for_model(arch: ModelArchConfig, kv_dtype: str | torch.dtype, page_bytes: int,
                  head_major: bool = True) -> "KVLayout":
        layout = KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_dtype_name(kv_dtype), page_bytes,
                          head_major)
        if layout.format.values_per_element == 2 and arch.head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim, got {arch.head_dim}")
        if layout.tokens_per_page < 1:
            raise ValueError(f"page_bytes {page_bytes} is smaller than one token's KV "
                             f"({layout.bytes_per_token} bytes); raise page_bytes")
        return layout

    @property
    def format(self) -> KVFormat:
        return KV_FORMATS[self.kv_dtype]

    @property
    def dtype(self) -> torch.dtype:
        return self.format.storage

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_elements(self) -> int:
        """Stored elements of one token's one head (int4: bytes holding two values each)."""
        return self.head_dim // self.format.values_per_element

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.element_bytes

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES if self.format.quantized else 0

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V across all layers, scales included."""
        return 2 * self.num_layers * self.num_kv_heads * (self.row_bytes + self.scale_bytes)

    @property
    def tokens_per_page(self) -> int:
        return self.page_bytes // self.bytes_per_token

    def layer_views(self, pool_bytes: torch.Tensor) -> list[KVCache]:
        """Each layer's K/V (and scale) views of the byte pool, logical shape [num_pages, tokens_per_page,
        kv_heads, row_elements] (scales [num_pages, tokens_per_page, kv_heads])."""
        if self.page_bytes % max(self.element_bytes, SCALE_BYTES):
            raise ValueError(f"page_bytes {self.page_bytes} is not a multiple of the KV element size")
        num_pages = pool_bytes.numel() // self.page_bytes
        pool = pool_bytes[: num_pages * self.page_bytes]
        data = pool.view(self.dtype)
        scales = pool.view(SCALE_DTYPE) if self.format.quantized else None
        tpp, heads, row = self.tokens_per_page, self.num_kv_heads, self.row_elements
        data_block = heads * tpp * row  # elements of one layer's K (or V)
        scale_start = 2 * self.num_layers * data_block * self.element_bytes // SCALE_BYTES
        views = []
        for layer in range(self.num_layers):
            k, v = (self._view(data, self.page_bytes // self.element_bytes, (2 * layer + i) * data_block, row)
                    for i in range(2))
            k_scale = v_scale = None
            if scales is not None:
                k_scale, v_scale = (self._view(scales, self.page_bytes // SCALE_BYTES,
                                               scale_start + (2 * layer + i) * heads * tpp, 1)[..., 0]
                                    for i in range(2))
            views.append(KVCache(k, v, k_scale, v_scale))
        return views

    def _view(self, typed: torch.Tensor, page_elements: int, offset: int, row: int) -> torch.Tensor:
        tpp, heads = self.tokens_per_page, self.num_kv_heads
        num_pages = typed.numel() // page_elements
        token_stride, head_stride = (row, tpp * row) if self.head_major else (heads * row, row)
        return typed.as_strided((num_pages, tpp, heads, row), (page_elements, token_stride, head_stride, 1),
                                typed.storage_offset() + offset)
