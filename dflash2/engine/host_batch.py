"""A step's inputs on the host: the flat batch's chunk order (decodes first) and its token, position, slot and
sampling lists (HostBatch), which the runner copies to the device and the CUDA graphs pack into their shapes.

    chunks ─► order_chunks() ─► [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ] ─► HostBatch.build()
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash2.engine.plan import ScheduledChunk
from dflash2.kernels.attention_metadata import PrefillSegment


def order_chunks(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], int]:
    """The flat batch's chunk order and its number of decode chunks: decodes first, longest context first (the
    decode kernel starts programs in row order, so the longest sequences are not left running alone at the end of
    the kernel; sorting ~256 rows costs tens of us a step), then the prefill chunks as planned."""
    decodes: list[ScheduledChunk] = []
    prefills: list[ScheduledChunk] = []
    for chunk in chunks:
        (decodes if chunk.is_decode else prefills).append(chunk)
    decodes.sort(key=lambda c: -c.start)
    return decodes + prefills, len(decodes)


@dataclass
class HostBatch:
    """The step's inputs as host lists, in flat-batch order."""

    token_ids: list[int]
    positions: list[int]
    token_slots: list[int]
    decode_lengths: list[int]
    segments: list[PrefillSegment]
    sample_rows: list[int]
    sample_chunks: list[int]  # index into the ordered chunks
    logit_chunks: list[tuple[int, int]]  # (chunk index, first row) of chunks wanting every logit
    has_placeholders: bool

    @staticmethod
    def build(chunks: list[ScheduledChunk], num_decodes: int) -> HostBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        segments: list[PrefillSegment] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        logit_chunks: list[tuple[int, int]] = []
        for index, chunk in enumerate(chunks):
            first_row = len(token_ids)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            token_slots.extend([chunk.slot] * chunk.num_tokens)
            if chunk.sample:
                sample_rows.append(len(token_ids) - 1)
                sample_chunks.append(index)
            if chunk.all_logits:
                logit_chunks.append((index, first_row))
            if index >= num_decodes:
                segments.append(PrefillSegment(first_row, chunk.num_tokens, chunk.start + chunk.num_tokens, chunk.slot))
        decode_lengths = [c.start + 1 for c in chunks[:num_decodes]]
        has_placeholders = bool(token_ids) and min(token_ids) < 0
        return HostBatch(token_ids, positions, token_slots, decode_lengths, segments, sample_rows, sample_chunks,
                          logit_chunks, has_placeholders)
