"""AttentionMetadata: where a step's new K/V go and what each query attends to.

    page_table [num_slots, max_pages]   persistent, on the device; row = a request's slot, updated in place
    flat batch  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]   decode rows (one token per request) first, then
                                                     prefill chunks; token t belongs to slot token_slots[t]
                                                     and sits at position positions[t]
A token's K/V go to page page_table[slot, pos // tokens_per_page], offset pos % tokens_per_page. Queries
attend causally to every earlier position of their request (the new K/V are written first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """One request's prefill chunk, as host integers (for the torch path and for sizing kernel grids)."""

    query_start: int  # first row in the flat batch
    query_len: int
    context_len: int  # positions attended by the chunk's last query, the chunk included
    slot: int


@dataclass
class AttentionMetadata:
    page_table: torch.Tensor  # [num_slots, max_pages] int32
    token_slots: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int = 0
    decode_lengths: torch.Tensor | None = None  # [num_decode] int32: positions attended, the new one included
    max_decode_length: int = 0  # host bound on decode_lengths (torch path); graphs use the model's limit
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Device copies of the prefill segments for kernels: [num_prefills + 1] starts, [num_prefills] the rest.
    prefill_query_starts: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    # Prefill query blocks for the Triton kernel: for each block, its segment and first query row in it.
    prefill_block_segments: torch.Tensor | None = None
    prefill_block_starts: torch.Tensor | None = None
    # What every layer derives alike from this metadata, filled by the first (the torch backend's cache rows,
    # decode pages and mask); the model's forward empties it first (ForwardContext.begin_forward).
    step_values: dict = field(default_factory=dict)

    @property
    def decode_slots(self) -> torch.Tensor:
        return self.token_slots[: self.num_decode_tokens]


@dataclass(frozen=True)
class KVCache:
    """One layer's paged K and V: typed views of the byte pool (engine/kv/layout.py says where they lie).

    k, v      [num_pages, tokens_per_page, kv_heads, head_dim] of the KV dtype; int4: [..., head_dim // 2]
              uint8, value 2j in the low nibble and 2j + 1 in the high one, each stored as q + 8
    k_scale   [num_pages, tokens_per_page, kv_heads] fp16 for quantized KV (x = q * scale), else None
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return kv_kind(self.k.dtype)


KV_KINDS = {torch.int8: "int8", torch.uint8: "int4", torch.float8_e4m3fn: "fp8"}


def kv_kind(dtype: torch.dtype) -> str:
    """"float" for a plain floating-point cache, else the quantized format its storage dtype stands for."""
    return KV_KINDS.get(dtype, "float")
