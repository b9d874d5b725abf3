"""DecodeGraphs: CUDA graphs of the decode step (forward + logits), one per padded batch size.

A decode-only step of B requests replays the graph of the smallest captured size b >= B. Inputs are
copied into static buffers; rows B..b-1 are padding that reads and writes only the scratch page (slot
`pad_slot`, position 0, length 1), and their logits are ignored.
"""
from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from dflash2.kernels.attention_metadata import AttentionMetadata
from dflash2.models.llama import ForwardContext

if TYPE_CHECKING:
    from dflash2.engine.runner import ModelRunner

logger = logging.getLogger("dflash2")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    step_size = 8
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += step_size if size < 64 else 16
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", batch_sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(batch_sizes)
        largest = self.sizes[-1]
        device = runner.device
        self.token_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), runner.pad_slot, dtype=torch.int32, device=device)
        self.lengths = torch.ones(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        vocab = runner.model.arch.vocab_size
        self.logits = torch.empty((largest, vocab), dtype=torch.float32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(size)
        logger.info("captured %d decode CUDA graphs for batch sizes %s", len(self.sizes), self.sizes)

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.sizes[-1]

    def run(self, token_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this decode batch; returns logits [B, vocab]."""
        batch = token_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(meta.positions)
        self.slots[:batch].copy_(meta.token_slots)
        self.lengths[:batch].copy_(meta.decode_lengths)
        if batch < size:
            self.token_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slots[batch:size].fill_(self.runner.pad_slot)
            self.lengths[batch:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[:batch]

    def _context(self, size: int) -> ForwardContext:
        meta = AttentionMetadata(page_table=self.runner.page_table, token_slots=self.slots[:size],
                                 positions=self.positions[:size], num_decode_tokens=size,
                                 decode_lengths=self.lengths[:size],
                                 max_decode_length=self.runner.options.max_model_len)
        return ForwardContext(positions=self.positions[:size], attention=meta, kv_caches=self.runner.kv_caches,
                              attention_backend=self.runner.attention)

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        module = self.runner.model.module
        attention = self.runner.attention
        from dflash2.kernels.triton.attention import decode_num_splits

        attention.graph_num_splits = decode_num_splits(size, self.runner.layout.num_kv_heads, attention.num_sms)
        try:
            context = self._context(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile kernels outside the capture
                    module.compute_logits(module(self.token_ids[:size], context))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:size].copy_(module.compute_logits(module(self.token_ids[:size], context)))
            self.graphs[size] = graph
        finally:
            attention.graph_num_splits = None
