"""ModelRunner: StepPlan -> device tensors -> model forward -> sampled tokens (the host lists: host_batch.py).

Owns one model's side of the KV cache: each layer's typed view of the pool's bytes (PoolStorage, shared by
every model of the engine), and the page table: one row per request slot,
updated in place from the pages each chunk adds. The flat batch puts decode chunks (one token) first:

    tokens:   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      decode rows attend over their pages in one batch;
    samples:    ^  ^  ^              ^        ^       each prefill chunk attends causally over its pages.

`launch()` queues the step on the device and returns at once; `collect()` waits for the sampled tokens
(copied to pinned host memory as the step ends). Sampled tokens also land in a device buffer, so the next
step can feed them back as inputs before the host has seen them: a negative input id -(i + 1) means
"the token in future slot i" (overlapped scheduling).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from dflash2.engine.graphs import GraphShape, StepGraphs
from dflash2.engine.guided import TokenMask, TokenMasks
from dflash2.engine.host_batch import HostBatch, order_chunks
from dflash2.engine.kv.layout import KVLayout
from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.engine.storage import PoolStorage
from dflash2.engine.sampler import Logprob, Sampler, SamplingRow, prompt_logprobs, sampled_logprobs
from dflash2.engine.transfer import to_device
from dflash2.kernels.attention_metadata import AttentionMetadata, PrefillSegment
from dflash2.kernels.dispatch import attention_backend
from dflash2.layers.embedding import resolve_placeholders
from dflash2.loading.model_loader import LoadedModel
from dflash2.models.llama import ForwardContext
from dflash2.request import Request

logger = logging.getLogger("dflash2")


@dataclass(frozen=True)
class RunnerOptions:
    attention_backend: str
    seed: int
    max_slots: int
    max_model_len: int
    enforce_eager: bool = False
    num_host_pages: int = 0  # pinned host pages for swapped-out KV


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # request id -> (first prompt position these entries are for, entries)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling failed (no token)


@dataclass
class PendingStep:
    """A step queued on the device; `placeholders[i]` stands for the token sampled for `sample_ids[i]`."""

    sample_ids: list[str]
    placeholders: list[int]
    tokens_host: torch.Tensor | None
    done: torch.cuda.Event | None
    logprob_job: tuple | None = None
    prompt_logprob_jobs: list[tuple] = field(default_factory=list)
    trace: dict | None = None  # the step's StepTrace record (DFLASH2_STEP_TRACE), written once collected
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why sampling its row failed


@contextlib.contextmanager
def _event_set(event: threading.Event) -> Iterator[None]:
    event.set()
    try:
        yield
    finally:
        event.clear()


class ModelRunner:
    def __init__(self, model: LoadedModel, layout: KVLayout, num_pages: int, options: RunnerOptions,
                 storage: PoolStorage | None = None) -> None:
        """`storage`: the pool's bytes, shared by every model's runner (None: a pool of `num_pages` of its own)."""
        self.model = model
        self.layout = layout
        self.options = options
        self.device = model.device
        self.last_graph: GraphShape | None = None  # the graph launch() replayed (None: eager), for the step trace
        self.storage = storage if storage is not None else PoolStorage(num_pages, layout.page_bytes,
                                                                       options.num_host_pages, self.device)
        self.num_pages = self.storage.num_pages
        self.scratch_page = self.storage.scratch_page
        self.kv_caches = layout.layer_views(self.storage.pool_bytes)
        self.max_pages_per_slot = -(-options.max_model_len // layout.tokens_per_page)
        self.pad_slot = options.max_slots  # an extra row whose pages are all the scratch page
        self.page_table = torch.full((options.max_slots + 1, self.max_pages_per_slot), self.scratch_page,
                                     dtype=torch.int32, device=self.device)
        self.attention = attention_backend(options.attention_backend)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(options.seed))
        self.future_tokens = torch.zeros(2 * options.max_slots, dtype=torch.long, device=self.device)
        self.future_base = 0  # where the next sampled tokens go: 0 or max_slots (alternating)
        # the sampled tokens' copies to the host, in the same alternating halves as future_tokens: a half is
        # written again two sampling steps later, after the step that used it was collected (the engine launches
        # a step only with at most one other in flight)
        self.tokens_host = torch.empty(2 * options.max_slots, dtype=torch.long,
                                       pin_memory=True) if self.device.type == "cuda" else None
        # ... copied on a stream of their own, so the next step's kernels need not queue behind the copy and its
        # launch gap on the main stream
        self.token_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._sampled = torch.cuda.Event() if self.token_stream is not None else None  # recorded each step
        self._last_copy: torch.cuda.Event | None = None  # the latest step's token copy to tokens_host
        self.token_masks: TokenMasks | None = None  # structured output's mask buffers, made on first use
        self.eos_token_ids: tuple[int, ...] = model.arch.eos_token_ids
        self.graphs: StepGraphs | None = None
        # set while collect() waits for the device (the GIL is free then): the engine process's metrics
        # renderer runs only in such waits, never beside the host's own work (server/engine_process.py)
        self.host_waits: threading.Event | None = None

    def capture_graphs(self, decode_sizes: list[int], mixed_shapes: list[tuple[int, int]] = ()) -> None:
        """Capture CUDA graphs of decode steps of these padded batch sizes, and of steps with prefill chunks
        of these (decode rows, prefill tokens) shapes (GPU with a graph-capable backend)."""
        if self.device.type == "cuda" and getattr(self.attention, "supports_graphs", False):
            self.graphs = StepGraphs(self, decode_sizes, list(mixed_shapes))
            self.warm_up_eager()

    @torch.inference_mode()
    def warm_up_eager(self) -> None:
        """Run eager mixed steps on the spare slot (its pages are the scratch page) before the first request: an
        eager step (a prefill over the graphs' largest) passes its kernels other metadata than the graphs do (int32
        on the host's allocations), so Triton compiles variants of its own, and W7 on an H100 stalled 0.8-1.7 s
        on each the first time a decode count met a new split count. One step per power of two of decode rows
        (the split count follows the rows' power of two), each with a prefill chunk and placeholder tokens.

        The placeholders read future slot 0, which the graphs' warm-ups have written with the argmax of rows
        that are padding (rows no attention segment covers hold whatever the memory held: NaN logits, any id).
        An id past the vocabulary made the embedding's gather assert on the device (qwen3-30b-a3b, smollm2 in
        the multi-model GPU test), so the slots are zeroed first: nothing has been sampled yet."""
        self.future_tokens.zero_()
        prompt = max(1, min(16, self.options.max_model_len - 2))
        for num_decodes in [0] + [1 << i for i in range(self.options.max_slots.bit_length())]:
            chunks = [ScheduledChunk(f"warm-up-{i}", 1, (-1,), self.pad_slot, 0, (), True) for i in range(num_decodes)]
            chunks.append(ScheduledChunk("warm-up-prefill", 0, (0,) * prompt, self.pad_slot, 0, (), True))
            self.forward_eager(HostBatch.build(chunks, num_decodes), num_decodes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Give back the device memory: graphs (and their pool), the model's weights, and its hold on the pool's
        storage. The runner is unusable afterwards."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.graphs is not None:
            for graph in self.graphs.graphs.values():
                graph.reset()
            self.graphs = None
        self.kv_caches = []
        self.storage = self.page_table = None  # the pool's bytes go with the last runner viewing them
        self.future_tokens = self.tokens_host = None
        self.token_stream = self._sampled = self._last_copy = self.token_masks = None
        self.model = None

    # -- the step ----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, requests: Mapping[str, Request]) -> StepResult:
        return self.collect(self.launch(plan, requests))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, requests: Mapping[str, Request]) -> PendingStep:
        self.storage.swap(plan.swap_out, plan.swap_in)
        self.last_graph = None
        if not plan.chunks:
            return PendingStep([], [], None, None)
        self.update_page_table(plan.chunks)
        ordered, num_decodes = order_chunks(plan.chunks)
        host = HostBatch.build(ordered, num_decodes)
        shape = self.graphs.shape_for(host, num_decodes) if self.graphs is not None else None
        self.last_graph = shape
        greedy = None
        if shape is not None:
            logits, greedy = self.graphs.run(shape, host, num_decodes)
            hidden = None
        else:
            hidden, logits = self.forward_eager(host, num_decodes)
        pending = self._sample(logits, [ordered[i] for i in host.sample_chunks], requests, greedy)
        for chunk_index, first_row in host.logit_chunks:
            chunk = ordered[chunk_index]
            job = self._prompt_logprob_job(chunk, hidden, first_row, requests[chunk.request_id])
            if job is not None:
                pending.prompt_logprob_jobs.append(job)
        return pending

    def forward_eager(self, host: HostBatch, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward without a graph: hidden states of every row, and the sampled rows' logits."""
        token_ids = self._resolve(to_device(host.token_ids, torch.long, self.device), host.has_placeholders)
        meta = self._metadata(host, num_decodes)
        context = ForwardContext(positions=meta.positions, attention=meta, kv_caches=self.kv_caches,
                                 attention_backend=self.attention)
        hidden = self.model.module(token_ids, context)
        # the rows through to_device (pinned, queued): indexing by a list copies it from pageable memory, which
        # held the host until the device had run the whole forward (W7's eager steps: launch = device time)
        rows = to_device(host.sample_rows, torch.long, self.device) if host.sample_rows else None
        logits = self.model.module.compute_logits(hidden.index_select(0, rows)) if rows is not None else None
        return hidden, logits

    def waiting_for_device(self) -> contextlib.AbstractContextManager:
        """Around a wait for the device: `host_waits`, if any, is set meanwhile (the server's metrics render then);
        without one (every step of an offline run) a null context."""
        return _event_set(self.host_waits) if self.host_waits is not None else contextlib.nullcontext()

    def collect(self, pending: PendingStep) -> StepResult:
        result = StepResult()
        if pending.done is not None:
            with self.waiting_for_device():
                pending.done.synchronize()
        if pending.tokens_host is not None:
            result.sampled = dict(zip(pending.sample_ids, pending.tokens_host.tolist()))
        result.failed = pending.failed
        if pending.logprob_job is not None:
            logits, token_ids, rows = pending.logprob_job
            for request_id, entries in zip(pending.sample_ids, sampled_logprobs(logits, token_ids, rows)):
                if entries is not None:
                    result.logprobs[request_id] = entries
        for request_id, start, logits, targets, num_top in pending.prompt_logprob_jobs:
            result.prompt_logprobs[request_id] = (start, prompt_logprobs(logits, targets, num_top))
        return result

    # -- inputs ------------------------------------------------------------------------------------
    def update_page_table(self, chunks: list[ScheduledChunk]) -> None:
        """Write the chunks' new pages into their rows of the page table (on CUDA: one copy to the device and
        one scatter into the flat table, no advanced indexing)."""
        width = self.page_table.shape[1]
        entries, pages = [], []
        for chunk in chunks:
            if chunk.new_page_ids:
                first = chunk.slot * width + chunk.new_pages_start
                entries.extend(range(first, first + len(chunk.new_page_ids)))
                pages.extend(chunk.new_page_ids)
        if not pages:
            return
        if self.device.type == "cpu":
            self.page_table.numpy().reshape(-1)[entries] = pages
            return
        packed = to_device(entries + pages, torch.int32, self.device)
        self.page_table.view(-1).index_copy_(0, packed[: len(entries)].long(), packed[len(entries):])

    def _resolve(self, token_ids: torch.Tensor, has_placeholders: bool) -> torch.Tensor:
        """Replace placeholder ids (-(i + 1)) by the tokens the previous step left in future slot i."""
        if not has_placeholders:
            return token_ids
        return resolve_placeholders(token_ids, self.future_tokens)

    def _metadata(self, host: HostBatch, num_decodes: int) -> AttentionMetadata:
        device = self.device
        meta = AttentionMetadata(
            page_table=self.page_table,
            token_slots=to_device(host.token_slots, torch.int32, device),
            positions=to_device(host.positions, torch.long, device),
            num_decode_tokens=num_decodes,
            prefills=host.segments,
        )
        if num_decodes:
            meta.decode_lengths = to_device(host.decode_lengths, torch.int32, device)
            meta.max_decode_length = max(host.decode_lengths)
        block_m = getattr(self.attention, "prefill_block_m", None)
        if host.segments and block_m:
            self._add_prefill_blocks(meta, host.segments, num_decodes, block_m)
        return meta

    def _add_prefill_blocks(self, meta: AttentionMetadata, segments: list[PrefillSegment], num_decodes: int,
                            block_m: int) -> None:
        starts = [s.query_start - num_decodes for s in segments]
        starts.append(starts[-1] + segments[-1].query_len)
        blocks = [(i, m) for i, s in enumerate(segments) for m in range(0, s.query_len, block_m)]
        # each row padded to 16 bytes: Triton compiles a kernel variant per pointer alignment, and rows of
        # len(segments) + 1 int32s gave the prefill kernel a new one for each remainder (a 1.5-1.7 s stall of
        # the step that first met it on an H100)
        width, count = -(-(len(segments) + 1) // 4) * 4, len(segments)
        packed = to_device([_padded(starts, width), _padded([s.context_len for s in segments], width),
                            _padded([s.slot for s in segments], width)], torch.int32, self.device)
        meta.prefill_query_starts = packed[0, :count + 1]
        meta.prefill_context_lens = packed[1, :count]
        meta.prefill_slots = packed[2, :count]
        width = -(-len(blocks) // 4) * 4
        block_info = to_device([_padded([b[0] for b in blocks], width), _padded([b[1] for b in blocks], width)],
                               torch.int32, self.device)
        meta.prefill_block_segments = block_info[0, :len(blocks)]
        meta.prefill_block_starts = block_info[1, :len(blocks)]

    # -- sampling ----------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor | None, chunks: list[ScheduledChunk],
                requests: Mapping[str, Request], greedy: torch.Tensor | None = None) -> PendingStep:
        """Sample the chunks' next tokens on the device. `greedy`: the logits' argmax rows, computed by a step
        graph (used when every row is greedy and nothing changes the logits)."""
        sample_ids = [c.request_id for c in chunks]
        if logits is None or not chunks:
            return PendingStep(sample_ids, [], None, None)
        rows = [self.sampling_row(requests[c.request_id]) for c in chunks]
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        token_mask = self._token_mask(rows) if any(r.guided is not None for r in rows) else None
        # the graph's greedy buffer is rewritten by its next replay: not for a logprob job read at collect
        failed: dict[str, str] = {}
        try:
            token_ids = self.sampler.sample_device(logits, rows, None if wants_logprobs else greedy, token_mask)
        except Exception:  # noqa: BLE001 - find the row that raised; its neighbours keep their tokens
            token_ids, failed = self._sample_each(logits, rows, sample_ids, token_mask)
        base = self.future_base
        self.future_base = self.options.max_slots - base  # alternate halves: 0, max_slots, 0, ...
        if greedy is None or token_ids is not greedy:  # a step graph stored its greedy tokens there itself
            self.future_tokens[base:base + len(chunks)] = token_ids
        placeholders = [-(base + i + 1) for i in range(len(chunks))]
        logprob_job = (logits.clone(), token_ids, rows) if wants_logprobs else None  # graph logits get reused
        if self.device.type != "cuda":
            return PendingStep(sample_ids, placeholders, token_ids, None, logprob_job, failed=failed)
        tokens_host = self.tokens_host[base:base + len(chunks)]
        done = torch.cuda.Event()
        # from the future slots just written (the graph's own buffer is rewritten by its next replay)
        self._sampled.record()  # the wait below is enqueued on this record (a later one does not move it)
        with torch.cuda.stream(self.token_stream):
            self.token_stream.wait_event(self._sampled)
            tokens_host.copy_(self.future_tokens[base:base + len(chunks)], non_blocking=True)
            done.record()
        self._last_copy = done
        return PendingStep(sample_ids, placeholders, tokens_host, done, logprob_job, failed=failed)

    def _token_mask(self, rows: list[SamplingRow]) -> TokenMask:
        """The masks of the rows with structured output (engine/guided.py): built on the host while this step's
        forward runs, copied to the device without waiting."""
        if self.token_masks is None:
            self.token_masks = TokenMasks(self.options.max_slots, self.model.arch.vocab_size, self.device)
        return self.token_masks.prepare(rows, self._known_token)

    def _known_token(self, token_id: int) -> int:
        """A token of a request's history: a placeholder -(slot + 1) is read from the previous step's host copy
        (waiting for that copy, which ends as this step's forward starts)."""
        if token_id >= 0:
            return token_id
        if self.tokens_host is None:
            return int(self.future_tokens[-token_id - 1])
        with self.waiting_for_device():
            self._last_copy.synchronize()
        return int(self.tokens_host[-token_id - 1])

    def _sample_each(self, logits: torch.Tensor, rows: list[SamplingRow], sample_ids: list[str],
                     token_mask: TokenMask | None = None) -> tuple[torch.Tensor, dict[str, str]]:
        """Sample row by row after the batch raised: the rows that raise again are the failed requests (token 0
        in their place); the others get their tokens as usual (guided ones within their masks)."""
        tokens, failed = [], {}
        masked = {row: k for k, row in enumerate(token_mask.rows)} if token_mask is not None else {}
        for index, (row, request_id) in enumerate(zip(rows, sample_ids)):
            k = masked.get(index)
            row_mask = TokenMask(token_mask.bitmask[k:k + 1], [0]) if k is not None else None
            try:
                tokens.append(self.sampler.sample_device(logits[index:index + 1], [row], token_mask=row_mask))
            except Exception as error:  # noqa: BLE001 - reported for this request alone
                logger.exception("sampling failed for request %s", request_id)
                failed[request_id] = f"sampling failed: {type(error).__name__}"
                tokens.append(torch.zeros(1, dtype=torch.long, device=logits.device))
        return torch.cat(tokens), failed

    def sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling_params
        # the history is copied only for rows that read it (penalties, or min_tokens not yet reached); a row
        # without it never changes, so the request keeps it from step to step
        needs_history = params.has_penalty or request.num_output_tokens < params.min_tokens
        if needs_history or request.sampling_row is None:
            row = SamplingRow(params=params, prompt_token_ids=request.prompt_token_ids,
                              output_token_ids=request.output_token_ids if needs_history else (),
                              generator=request.generator, eos_token_ids=self.eos_token_ids, guided=request.guided)
            if needs_history:
                return row
            request.sampling_row = row
        return request.sampling_row

    def _prompt_logprob_job(self, chunk: ScheduledChunk, hidden: torch.Tensor, first_row: int,
                            request: Request) -> tuple | None:
        """Logits predicting prompt tokens start+1 .. within the prompt, for collect() to turn into logprobs."""
        last_position = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
        count = last_position - chunk.start
        if count <= 0:
            return None
        logits = self.model.module.compute_logits(hidden[first_row:first_row + count])
        targets = request.prompt_token_ids[chunk.start + 1:chunk.start + 1 + count]
        return (chunk.request_id, chunk.start + 1, logits, targets, request.sampling_params.prompt_logprobs or 0)


def _padded(values: list[int], width: int) -> list[int]:
    """values followed by zeros up to `width`."""
    return values + [0] * (width - len(values))
