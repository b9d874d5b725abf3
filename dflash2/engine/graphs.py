"""DecodeGraphs: CUDA graphs of the decode step (forward + logits), one per padded batch size.

A decode-only step of B requests replays the graph of the smallest captured size b >= B. The host packs
the step's inputs into one pinned buffer, copied with a single transfer into the graph's static input
block laid out as

    inputs[: 4 * b] = [ token ids (negative: placeholder) | positions | slots | lengths ]   (int64)

Placeholders are resolved inside the graph from the runner's future-token buffer. Rows B..b-1 are padding
that reads and writes only the scratch page (slot `pad_slot`, position 0, length 1); their logits are
ignored.
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
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 16
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", batch_sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sorted(batch_sizes)
        largest = self.sizes[-1]
        device = runner.device
        self.inputs = torch.zeros(4 * largest, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's own output (model dtype), read after replay
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self._capture(size)
        logger.info("captured %d decode CUDA graphs for batch sizes %s", len(self.sizes), self.sizes)

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.sizes[-1]

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], lengths: list[int]) -> torch.Tensor:
        """Replay the graph for this decode batch (host lists, one entry per request); logits [B, vocab]."""
        batch = len(token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        pad = size - batch
        packed = torch.tensor(token_ids + [0] * pad + positions + [0] * pad
                              + slots + [self.runner.pad_slot] * pad + lengths + [1] * pad,
                              dtype=torch.long, pin_memory=True)
        self.inputs[: 4 * size].copy_(packed, non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:batch]

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        from dflash2.kernels.triton.attention import decode_num_splits

        runner = self.runner
        module = runner.model.module
        attention = runner.attention
        block = self.inputs[: 4 * size].view(4, size)
        block[2].fill_(runner.pad_slot)
        block[3].fill_(1)
        meta = AttentionMetadata(page_table=runner.page_table, token_slots=block[2], positions=block[1],
                                 num_decode_tokens=size, decode_lengths=block[3],
                                 max_decode_length=runner.options.max_model_len)
        context = ForwardContext(positions=block[1], attention=meta, kv_caches=runner.kv_caches,
                                 attention_backend=attention)

        def step() -> torch.Tensor:
            ids = block[0]
            resolved = torch.where(ids < 0, runner.future_tokens[(-ids - 1).clamp(min=0)], ids)
            return module.compute_logits(module(resolved, context))

        layout = runner.layout
        attention.graph_num_splits = decode_num_splits(size, layout.num_kv_heads, attention.num_sms,
                                                       runner.model.arch.num_heads // layout.num_kv_heads)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile kernels outside the capture
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = step()
            self.graphs[size] = graph
        finally:
            attention.graph_num_splits = None
