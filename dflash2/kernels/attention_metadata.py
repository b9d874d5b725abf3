"""AttentionMetadata: where a step's new K/V go and what each query attends to (device tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """One request's prefill chunk: queries [query_start, query_start + query_len) of the flat batch.

    The chunk's queries sit at positions [context_len - query_len, context_len); they attend causally to
    all `context_len` tokens, whose KV is in `page_table` (the new ones are written before attention).
    """

    query_start: int
    query_len: int
    context_len: int
    page_table: torch.Tensor  # [num_pages] long


@dataclass
class AttentionMetadata:
    """The flat batch holds `num_decode_tokens` decode rows (one per request) first, then prefill chunks."""

    slot_pages: torch.Tensor  # [num_tokens] long: page receiving each new token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] long: its position inside that page
    num_decode_tokens: int = 0
    decode_page_table: torch.Tensor | None = None  # [num_decode, max_pages] long, padded with page 0
    decode_lengths: torch.Tensor | None = None  # [num_decode] long: tokens attended, the new one included
    decode_max_length: int = 0
    prefills: list[PrefillSegment] = field(default_factory=list)
