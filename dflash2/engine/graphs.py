"""StepGraphs: CUDA graphs of whole steps (forward + logits), decode-only and mixed, at padded shapes.

A step is replayed from the graph of its padded shape (D, P): D decode rows (one token each) and P prefill
rows (chunks of prompts, any number of them). Decode-only steps (P = 0) use fine batch buckets; steps with
prefill chunks use powers of two for both up to a step size, then multiples of it (MIXED_DECODE_STEP,
MIXED_PREFILL_STEP), up to `max_num_seqs` and `max_prefill_tokens`. Anything else (larger prefills, chunks
that want prompt logprobs) runs eagerly. Without graphs an eager step costs the host one Python launch per
kernel (~170 for a Qwen3-0.6B step, 10-25 ms), which is what an urgent request's first token waited for.

The host packs the step's inputs into one pinned buffer, copied with a single transfer into the graph's
static input block (int64), laid out as

    [ token ids | positions | slots ]  D + P each: decode rows, padding to D, prefill rows, padding to P
    [ decode lengths ]                 D
    [ logit rows ]                     D + S: which rows to compute logits for (decode rows, then each
                                       sampling chunk's last row)
    [ query starts ]                   S + 2: each chunk's first prefill row, then P' (real prefill rows) twice
    [ context lengths | slots ]        S + 1 each
    [ block segments | block starts ]  B each: the prefill kernel's query blocks
    [ future base ]                    1: where the step's sampled tokens go in the runner's future slots (the
                                       graph's argmax stores its greedy tokens there; runner._sample)

with S = min(max_slots, P) chunks at most and B = ceil(P / block_m) + S blocks. Padding rows belong to the
spare slot `pad_slot` (all its pages are the scratch page) at position 0 with length 1; padding blocks point
at segment S' (one past the real ones), whose query length and context are 0, so they return at once. Token
ids may be placeholders, resolved inside the graph from the runner's future-token buffer.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash2.engine.sampler import greedy_argmax
from dflash2.engine.transfer import copy_ints_
from dflash2.kernels.attention_metadata import AttentionMetadata
from dflash2.models.llama import ForwardContext

if TYPE_CHECKING:
    from dflash2.engine.host_batch import HostBatch
    from dflash2.engine.runner import ModelRunner

logger = logging.getLogger("dflash2")

MIN_PREFILL_BUCKET = 16
# A mixed graph computes its padded rows' linear layers too: W7 on an H100 (llama-3-8b, 512 sequences) spent 9.4
# of its 27 s in mixed steps of ~507 decode rows and ~500-2000 prefill tokens, replayed at powers of two ([512,
# 2048] for 1,100 prefill tokens: 2,560 rows computed for 1,607). Above these sizes the buckets go up by them.
MIXED_DECODE_STEP = 128
MIXED_PREFILL_STEP = 256


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode-only buckets: 1, 2, 4, 8, then every 8 up to 64, then every 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 16
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def _buckets(first: int, step: int, limit: int) -> list[int]:
    """first, 2 * first, ... (powers of two) below `step`, then multiples of `step` below `limit`, then
    `limit` itself."""
    sizes, size = [], first
    while size < min(step, limit):
        sizes.append(size)
        size *= 2
    size = step
    while size < limit:
        sizes.append(size)
        size += step
    return sizes + [limit]


def mixed_graph_shapes(max_num_seqs: int, max_prefill_tokens: int) -> list[tuple[int, int]]:
    """(decode rows, prefill rows) of the mixed graphs: decode 0, 1, 2, 4, ... 64, then every MIXED_DECODE_STEP
    up to max_num_seqs, by prefill 16, 32, ... 128, then every MIXED_PREFILL_STEP up to max_prefill_tokens; none
    when max_prefill_tokens is 0."""
    if max_prefill_tokens <= 0:
        return []
    decodes = [0] + _buckets(1, MIXED_DECODE_STEP, max_num_seqs)
    prefills = _buckets(MIN_PREFILL_BUCKET, MIXED_PREFILL_STEP, max(MIN_PREFILL_BUCKET, max_prefill_tokens))
    return [(d, p) for d in decodes for p in prefills]


@dataclass(frozen=True)
class GraphShape:
    """One graph's padded shape and where each input lies in its block."""

    decodes: int  # D
    prefill_tokens: int  # P
    max_segments: int  # S
    num_blocks: int  # B
    # one decode row over a short context (at most the backend's short_max_tokens): its decode attention runs
    # the backend's short split count and config (kernels/triton/attention.py's SHORT_*)
    short: bool = False

    @staticmethod
    def of(decodes: int, prefill_tokens: int, max_slots: int, block_m: int, short: bool = False) -> "GraphShape":
        segments = min(max_slots, prefill_tokens)
        blocks = -(-prefill_tokens // block_m) + segments if prefill_tokens else 0
        return GraphShape(decodes, prefill_tokens, segments, blocks, short)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_tokens

    @property
    def logit_rows(self) -> int:
        return self.decodes + self.max_segments

    @property
    def sections(self) -> list[tuple[str, int]]:
        t, s, b = self.tokens, self.max_segments, self.num_blocks
        sections = [("ids", t), ("positions", t), ("slots", t), ("lengths", self.decodes)]
        if self.prefill_tokens:
            sections += [("logit_rows", self.logit_rows), ("query_starts", s + 2), ("context_lens", s + 1),
                         ("segment_slots", s + 1), ("block_segments", b), ("block_starts", b)]
        return sections + [("future_base", 1)]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.sections)


def pack_inputs(shape: GraphShape, host: "HostBatch", num_decodes: int, pad_slot: int, block_m: int,
                future_base: int = 0) -> list[int]:
    """The step's host batch (decode rows first, then prefill chunks) laid out as `shape`'s input block."""
    d, p_real = num_decodes, len(host.token_ids) - num_decodes
    pad_d, pad_p = shape.decodes - d, shape.prefill_tokens - p_real

    def rows(values: list[int], decode_pad: int, prefill_pad: int) -> list[int]:
        return values[:d] + [decode_pad] * pad_d + values[d:] + [prefill_pad] * pad_p

    packed = (rows(host.token_ids, 0, 0) + rows(host.positions, 0, 0) + rows(host.token_slots, pad_slot, pad_slot)
              + host.decode_lengths + [1] * pad_d)
    if not shape.prefill_tokens:
        return packed + [future_base]
    segments = host.segments
    s_cap, real = shape.max_segments, len(segments)
    logit_rows = [r if r < d else r + pad_d for r in host.sample_rows]
    starts = [seg.query_start - d for seg in segments] + [p_real] * (s_cap + 2 - real)
    blocks = [(i, m) for i, seg in enumerate(segments) for m in range(0, seg.query_len, block_m)]
    blocks += [(real, 0)] * (shape.num_blocks - len(blocks))
    return (packed + logit_rows + [0] * (shape.logit_rows - len(logit_rows)) + starts
            + [seg.context_len for seg in segments] + [0] * (s_cap + 1 - real)
            + [seg.slot for seg in segments] + [pad_slot] * (s_cap + 1 - real)
            + [b[0] for b in blocks] + [b[1] for b in blocks] + [future_base])


def _round_up(value: int, sizes: list[int]) -> int | None:
    """The smallest of the sorted `sizes` >= value, or None."""
    index = bisect.bisect_left(sizes, value)
    return sizes[index] if index < len(sizes) else None


class StepGraphs:
    def __init__(self, runner: "ModelRunner", decode_sizes: list[int],
                 mixed_shapes: list[tuple[int, int]] = (), capture: bool = True) -> None:
        """`capture=False` runs each step eagerly at its padded shape instead of replaying a graph: the same
        inputs and metadata without CUDA (the CPU tests check the padding with it)."""
        self.runner = runner
        self.capture = capture
        self.future_tokens = runner.future_tokens
        self.block_m = getattr(runner.attention, "prefill_block_m", None) or 64
        max_slots = runner.options.max_slots
        shapes = [GraphShape.of(d, 0, max_slots, self.block_m) for d in decode_sizes]
        shapes += [GraphShape.of(d, p, max_slots, self.block_m) for d, p in mixed_shapes]
        # a single stream over a short context: a graph of its own where the backend has a short decode
        short = getattr(runner.attention, "short_decode", lambda dtype: False)(runner.layout.dtype)
        self.short_max_tokens = runner.attention.short_max_tokens if short and 1 in decode_sizes else 0
        if self.short_max_tokens:
            shapes.append(GraphShape.of(1, 0, max_slots, self.block_m, short=True))
        self.shapes = sorted(set(shapes), key=lambda s: (s.tokens, s.decodes, s.short))
        self._by_size = {(s.decodes, s.prefill_tokens, s.short): s for s in self.shapes}
        self._decode_sizes = sorted(set(decode_sizes))
        self._mixed_decodes = sorted({d for d, _ in mixed_shapes})
        self._mixed_prefills = sorted({p for _, p in mixed_shapes})
        self.inputs = torch.zeros(max(s.size for s in self.shapes), dtype=torch.long, device=runner.device)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        # each graph's logits (model dtype): every graph copies its own into one buffer of the most rows any of
        # them has, so their outputs take no memory each in the graph pool (a decode graph's own output held
        # [D, vocab] for the engine's life: 8.6 GB at 1024 sequences of a 128k vocabulary, memory the KV pool
        # lost); the copy is ~2 x D x vocab bytes a step (~90 us at 512 rows on an H100)
        self.logits: dict[GraphShape, torch.Tensor] = {}
        # each graph's greedy tokens (the argmax of every logits row, computed in the graph: an all-greedy step
        # then launches nothing after the replay to sample)
        self.greedy: dict[GraphShape, torch.Tensor] = {}
        self.logit_rows = max(s.logit_rows for s in self.shapes)
        self.step_logits: torch.Tensor | None = None  # made by the first (largest) warm-up, outside any capture
        self.steps: dict[GraphShape, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}  # capture=False
        self.replays: Counter[GraphShape] = Counter()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # one side stream for every warm-up: cuBLAS keeps a workspace per stream it ran on (32 MiB on Hopper) for
        # the process's life, so a stream per graph held ~1 GiB after the engine was closed
        self._warm_up_stream = torch.cuda.Stream() if capture else None
        for shape in reversed(self.shapes):  # largest first, so smaller graphs reuse its memory
            self._capture(shape)
        logger.info("%s %d CUDA graphs: decode batches %s; decode x prefill tokens %s",
                    "captured" if capture else "built (not captured)", len(self.shapes),
                    sorted(decode_sizes), sorted(set(mixed_shapes)))

    def shape_for(self, host: "HostBatch", num_decodes: int) -> GraphShape | None:
        """The smallest graph this step fits, or None (run it eagerly)."""
        if host.logit_chunks:  # prompt logprobs read every row's hidden state
            return None
        prefill_tokens = len(host.token_ids) - num_decodes
        if not prefill_tokens:
            if num_decodes == 1 and host.decode_lengths[0] <= self.short_max_tokens:
                return self._by_size[(1, 0, True)]
            decodes = _round_up(num_decodes, self._decode_sizes)
            return None if decodes is None else self._by_size[(decodes, 0, False)]
        decodes = _round_up(num_decodes, self._mixed_decodes)
        prefills = _round_up(prefill_tokens, self._mixed_prefills)
        if decodes is None or prefills is None:
            return None
        shape = self._by_size[(decodes, prefills, False)]
        return shape if len(host.segments) <= shape.max_segments else None

    def run(self, shape: GraphShape, host: "HostBatch", num_decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay `shape`'s graph for this step: logits [rows sampled, vocab] in host.sample_rows order, and
        their greedy tokens. Both are the graph's buffers, rewritten by its next replay."""
        copy_ints_(self.inputs, pack_inputs(shape, host, num_decodes, self.runner.pad_slot, self.block_m,
                                            self.runner.future_base))
        self.replays[shape] += 1
        rows = len(host.sample_rows)
        if not self.capture:
            logits, greedy = self.steps[shape]()
            return logits[:rows], greedy[:rows]
        self.graphs[shape].replay()
        return self.logits[shape][:rows], self.greedy[shape][:rows]

    def _views(self, shape: GraphShape) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, length in shape.sections:
            views[name] = self.inputs[offset:offset + length]
            offset += length
        return views

    def _metadata(self, shape: GraphShape, v: dict[str, torch.Tensor]) -> AttentionMetadata:
        runner = self.runner
        meta = AttentionMetadata(page_table=runner.page_table, token_slots=v["slots"], positions=v["positions"],
                                 num_decode_tokens=shape.decodes, decode_lengths=v["lengths"],
                                 max_decode_length=runner.options.max_model_len)
        if shape.prefill_tokens:
            meta.prefill_query_starts = v["query_starts"]
            meta.prefill_context_lens = v["context_lens"]
            meta.prefill_slots = v["segment_slots"]
            meta.prefill_block_segments = v["block_segments"]
            meta.prefill_block_starts = v["block_starts"]
        return meta

    def _fill_idle(self, shape: GraphShape, v: dict[str, torch.Tensor]) -> None:
        """Inputs of an all-padding step, for the warm-up and the capture."""
        pad = self.runner.pad_slot
        v["slots"].fill_(pad)
        v["lengths"].fill_(1)
        if shape.prefill_tokens:
            v["segment_slots"].fill_(pad)
            v["context_lens"].zero_()
            v["query_starts"].zero_()
            v["block_segments"].zero_()
            v["block_starts"].zero_()
            v["logit_rows"].zero_()

    def _build_step(self, shape: GraphShape) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The step at this padded shape, reading only the static input block: what gets captured."""
        runner = self.runner
        module = runner.model.module
        v = self._views(shape)
        self._fill_idle(shape, v)
        context = ForwardContext(positions=v["positions"], attention=self._metadata(shape, v),
                                 kv_caches=runner.kv_caches, attention_backend=runner.attention)

        # the greedy tokens also go to the runner's future slots, at the step's base (one copy fewer a step)
        future = (self.future_tokens, v["future_base"])

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            ids = v["ids"]
            # the short graph's decode attention (captured or run eagerly): the backend's short splits and config
            with runner.attention.short_decoding() if shape.short else contextlib.nullcontext():
                hidden = module(ids, context, future_tokens=self.future_tokens)
            if shape.prefill_tokens:
                hidden = hidden.index_select(0, v["logit_rows"])
            logits = module.compute_logits(hidden)
            if self.step_logits is None:
                self.step_logits = logits.new_empty((self.logit_rows, logits.shape[1]))
            out = self.step_logits[: logits.shape[0]]
            out.copy_(logits)
            return out, greedy_argmax(out, future)

        return step

    @torch.inference_mode()
    def _capture(self, shape: GraphShape) -> None:
        from dflash2.kernels.triton.attention import decode_num_splits

        step = self._build_step(shape)
        if not self.capture:
            self.steps[shape] = step
            return
        runner = self.runner
        attention = runner.attention
        layout = runner.layout
        attention.graph_num_splits = decode_num_splits(max(1, shape.decodes), layout.num_kv_heads,
                                                       attention.num_sms,
                                                       runner.model.arch.num_heads // layout.num_kv_heads)
        try:
            self._warm_up_and_capture(shape, step)
        finally:
            attention.graph_num_splits = None

    def _warm_up_and_capture(self, shape: GraphShape,
                             step: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        stream = self._warm_up_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up: compile kernels and pick GEMM algorithms outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: a finalizer freeing pinned host memory (an earlier
        # engine's pools in the same process) queries CUDA events, which a capture does not permit; and
        # other threads' CUDA calls do not invalidate it (thread_local).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[shape], self.greedy[shape] = step()
        finally:
            if collecting:
                gc.enable()
        self.graphs[shape] = graph
