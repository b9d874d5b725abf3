"""ExpressLane: an urgent request's prompt runs beside the main steps, on a stream of its own.

Under load an urgent arrival waits for the main step in flight, then the one already launched after it, then
runs in a step shared with every running decode. The express lane skips both waits: the engine hands it the
head of the line when that request outranks a running one (Scheduler.take_express; at least
`express_min_priority` urgent, if set), at a step's start or as the server's engine loop takes the arrival in
while a step waits for the device (Engine.on_device_wait), and it runs the whole prompt at once, on a
high-priority CUDA stream, from CUDA graphs of its own (0 decode rows x 16, 32, ... `max_tokens` prompt
tokens), beside the main steps in flight. Its first token is committed as soon as it has run; the next main
step is planned after that, and the request decodes in the main steps from then on.

    main stream:    ... step N (in flight) ... | step N+1 (launched) ... | N+2 (the request decodes here on)
    express stream:   [ urgent prompt, graph ]  -> first token

What makes running beside the main steps safe:
  - its pages and page-table slot are settled ones (PagePool / KVManager): nothing a main step in flight reads
    or writes; the prefix pages it reads hold final KV;
  - its graphs have their own inputs, memory pool, future slots, split-K tickets and cuBLAS workspace
    (graphs.GraphLane);
  - its page-table row is written on its stream, and the main stream waits for its event before the request's
    first decode step (join_main).
Without CUDA (the CPU tests) the lane runs its prompt eagerly on the caller's thread: the same scheduling and
commits, with nothing to overlap.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from dflash2.engine.graphs import MIN_PREFILL_BUCKET, GraphLane, StepGraphs
from dflash2.engine.plan import ScheduledChunk
from dflash2.request import Request

if TYPE_CHECKING:
    from dflash2.engine.runner import ModelRunner, PendingStep


def lane_prefill_sizes(max_tokens: int) -> list[int]:
    """The lane graphs' prompt sizes: 16, 32, ... up to max_tokens (itself included)."""
    sizes, size = [], MIN_PREFILL_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


class ExpressLane:
    def __init__(self, runner: "ModelRunner", max_tokens: int) -> None:
        self.runner = runner
        self.max_tokens = max_tokens
        device = runner.device
        self.cuda = device.type == "cuda"
        # the highest priority a stream can have: its blocks are scheduled ahead of the main stream's waiting ones
        self.stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1]) if self.cuda \
            else None
        self.tokens_host = torch.empty(1, dtype=torch.long, pin_memory=True) if self.cuda else None
        self.future_tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: StepGraphs | None = None
        self.num_launches = 0

    def capture_graphs(self) -> None:
        """The lane's graphs (CUDA with a graph-capable attention backend); on CUDA the engine runs no lane
        without them (Engine._express_lane)."""
        if self.cuda and getattr(self.runner.attention, "supports_graphs", False):
            lane = GraphLane("express", self.future_tokens, torch.cuda.Stream(self.runner.device))
            shapes = [(0, p) for p in lane_prefill_sizes(self.max_tokens)]
            self.graphs = StepGraphs(self.runner, [], shapes, lane=lane)

    @staticmethod
    def can_run(request: Request) -> bool:
        """Whether the lane can take this request's prompt: not one that wants logprobs (the lane samples its
        graph's logits, which its next replay rewrites)."""
        return not request.wants_prompt_logprobs and request.sampling_params.logprobs is None

    @torch.inference_mode()
    def launch(self, chunk: ScheduledChunk, requests: Mapping[str, Request]) -> "PendingStep":
        """Queue the prompt chunk (one that samples) on the lane; collect it with runner.collect()."""
        from dflash2.engine.runner import PendingStep, _HostBatch

        runner = self.runner
        self.num_launches += 1
        request = requests[chunk.request_id]
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            runner.update_page_table([chunk])
            host = _HostBatch.build([chunk], 0)
            greedy = None
            if self.graphs is not None:
                shape = self.graphs.shape_for(host, 0)
                assert shape is not None, f"no express graph for {len(host.token_ids)} tokens"
                logits, greedy = self.graphs.run(shape, host, 0)
            else:
                _, logits = runner.forward_eager(host, 0)
            token_ids = runner.sampler.sample_device(logits, [runner.sampling_row(request)], greedy)
            if not self.cuda:
                return PendingStep([chunk.request_id], [], token_ids, None)
            self.tokens_host.copy_(token_ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return PendingStep([chunk.request_id], [], self.tokens_host, done)

    def join_main(self, pending: "PendingStep") -> None:
        """Order the main stream after the lane's step (its KV and page-table row), before the request decodes."""
        if pending.done is not None:
            torch.cuda.current_stream(self.runner.device).wait_event(pending.done)
