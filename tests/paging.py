"""Shared by the attention tests (CPU and GPU): random page tables and mixed decode/prefill metadata."""
from __future__ import annotations

import random

import torch

from dflash2.kernels.attention_metadata import AttentionMetadata, PrefillSegment


def random_page_table(lengths: list[int], tokens_per_page: int, num_pages: int, seed: int,
                      device: str = "cpu") -> torch.Tensor:
    """Each slot gets distinct random pages covering its length ([slots, widest] int32)."""
    rng = random.Random(seed)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    table = torch.zeros((len(lengths), max(-(-n // tokens_per_page) for n in lengths)), dtype=torch.int32)
    for slot, n in enumerate(lengths):
        for i in range(-(-n // tokens_per_page)):
            table[slot, i] = pages.pop()
    return table.to(device)


def mixed_batch_metadata(shapes: list[tuple[int, int]], table: torch.Tensor, block_m: int) -> AttentionMetadata:
    """(context, query length) per request, the decodes (query length 1) first: slots, positions, prefill
    segments and the prefill kernel's blocks of `block_m` queries, in the engine's row order, on the table's
    device."""
    device = table.device
    slots, positions, segments, row = [], [], [], 0
    for slot, (context, qlen) in enumerate(shapes):
        slots += [slot] * qlen
        positions += list(range(context - qlen, context))
        if qlen > 1:
            segments.append(PrefillSegment(row, qlen, context, slot))
        row += qlen
    decode_lengths = [c for c, n in shapes if n == 1]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    meta = AttentionMetadata(page_table=table, token_slots=as_int(slots),
                             positions=torch.tensor(positions, device=device), num_decode_tokens=len(decode_lengths),
                             decode_lengths=as_int(decode_lengths), max_decode_length=max(decode_lengths, default=0),
                             prefills=segments)
    nd = len(decode_lengths)
    starts = [s.query_start - nd for s in segments] + [segments[-1].query_start - nd + segments[-1].query_len]
    blocks = [(i, m) for i, s in enumerate(segments) for m in range(0, s.query_len, block_m)]
    meta.prefill_query_starts = as_int(starts)
    meta.prefill_context_lens = as_int([s.context_len for s in segments])
    meta.prefill_slots = as_int([s.slot for s in segments])
    meta.prefill_block_segments = as_int([b[0] for b in blocks])
    meta.prefill_block_starts = as_int([b[1] for b in blocks])
    return meta
