"""ModelRunner: StepPlan -> device tensors -> model forward -> sampled tokens (a StepResult).

Owns the device side of the KV cache: one byte buffer for the page pool and each layer's typed view of it.
The flat batch puts single-token (decode) chunks first, then prefill chunks:

    tokens:   [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      decode rows attend over their pages in one batch;
    samples:    ^  ^  ^              ^        ^       each prefill chunk attends causally over its pages.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dflash2.engine.kv.layout import KVLayout
from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.engine.sampler import Logprob, Sampler, SamplingRow, prompt_logprobs
from dflash2.kernels.attention_metadata import AttentionMetadata, PrefillSegment
from dflash2.kernels.dispatch import attention_backend
from dflash2.loading.model_loader import LoadedModel
from dflash2.models.llama import ForwardContext
from dflash2.request import Request


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # request id -> (first prompt position these entries are for, entries)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)


@dataclass
class _Batch:
    token_ids: torch.Tensor
    context: ForwardContext
    sample_rows: list[int]  # flat-batch index of each sampled chunk's last token
    sample_chunks: list[ScheduledChunk]
    logit_chunks: list[tuple[ScheduledChunk, int]]  # chunks wanting all logits, with their first row


class ModelRunner:
    def __init__(self, model: LoadedModel, layout: KVLayout, num_pages: int, backend: str, seed: int) -> None:
        self.model = model
        self.layout = layout
        self.device = model.device
        self.num_pages = num_pages
        self.pool_bytes = torch.zeros(num_pages * layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.kv_caches = layout.layer_views(self.pool_bytes)
        self.attention = attention_backend(backend)
        default_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(default_generator)
        self.eos_token_ids = model.arch.eos_token_ids

    @torch.inference_mode()
    def execute(self, plan: StepPlan, requests: Mapping[str, Request]) -> StepResult:
        batch = self._prepare(plan)
        hidden = self.model.module(batch.token_ids, batch.context)
        result = StepResult()
        if batch.sample_rows:
            logits = self.model.module.compute_logits(hidden[batch.sample_rows])
            rows = [self._sampling_row(requests[c.request_id]) for c in batch.sample_chunks]
            out = self.sampler.sample(logits, rows)
            for chunk, token, logprobs in zip(batch.sample_chunks, out.token_ids, out.logprobs):
                result.sampled[chunk.request_id] = token
                if logprobs is not None:
                    result.logprobs[chunk.request_id] = logprobs
        for chunk, first_row in batch.logit_chunks:
            self._prompt_logprobs(chunk, hidden, first_row, requests[chunk.request_id], result)
        return result

    # -- batch construction ------------------------------------------------------------------------
    def _prepare(self, plan: StepPlan) -> _Batch:
        decodes = [c for c in plan.chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in plan.chunks if not (c.num_tokens == 1 and c.start > 0)]
        tpp = self.layout.tokens_per_page
        token_ids: list[int] = []
        positions: list[int] = []
        slot_pages: list[int] = []
        slot_offsets: list[int] = []
        sample_rows, sample_chunks, logit_chunks = [], [], []
        segments: list[PrefillSegment] = []
        for chunk in decodes + prefills:
            first_row = len(token_ids)
            token_ids.extend(chunk.token_ids)
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            positions.extend(span)
            slot_pages.extend(chunk.page_ids[p // tpp] for p in span)
            slot_offsets.extend(p % tpp for p in span)
            if chunk.sample:
                sample_rows.append(len(token_ids) - 1)
                sample_chunks.append(chunk)
            if chunk.all_logits:
                logit_chunks.append((chunk, first_row))
            if first_row >= len(decodes):
                segments.append(self._segment(chunk, first_row))
        device = self.device
        meta = AttentionMetadata(
            slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
            num_decode_tokens=len(decodes),
            prefills=segments,
        )
        if decodes:
            self._add_decode_tables(meta, decodes)
        context = ForwardContext(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attention=meta, kv_caches=self.kv_caches, attention_backend=self.attention)
        return _Batch(torch.tensor(token_ids, dtype=torch.long, device=device), context,
                      sample_rows, sample_chunks, logit_chunks)

    def _segment(self, chunk: ScheduledChunk, first_row: int) -> PrefillSegment:
        context_len = chunk.start + chunk.num_tokens
        num_pages = -(-context_len // self.layout.tokens_per_page)
        table = torch.tensor(chunk.page_ids[:num_pages], dtype=torch.long, device=self.device)
        return PrefillSegment(first_row, chunk.num_tokens, context_len, table)

    def _add_decode_tables(self, meta: AttentionMetadata, decodes: list[ScheduledChunk]) -> None:
        lengths = [c.start + 1 for c in decodes]
        max_length = max(lengths)
        width = -(-max_length // self.layout.tokens_per_page)
        table = [list(c.page_ids[:width]) + [0] * (width - min(width, len(c.page_ids))) for c in decodes]
        meta.decode_page_table = torch.tensor(table, dtype=torch.long, device=self.device)
        meta.decode_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        meta.decode_max_length = max_length

    # -- sampling ----------------------------------------------------------------------------------
    def _sampling_row(self, request: Request) -> SamplingRow:
        return SamplingRow(params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                           output_token_ids=request.output_token_ids, generator=request.generator,
                           eos_token_ids=self.eos_token_ids)

    def _prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor, first_row: int,
                         request: Request, result: StepResult) -> None:
        """Logprobs of prompt tokens start+1 .. (predicted by positions start .. ) within the prompt."""
        last_position = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
        count = last_position - chunk.start
        if count <= 0:
            return
        logits = self.model.module.compute_logits(hidden[first_row:first_row + count])
        targets = request.prompt_token_ids[chunk.start + 1:chunk.start + 1 + count]
        entries = prompt_logprobs(logits, targets, request.sampling_params.prompt_logprobs or 0)
        result.prompt_logprobs[chunk.request_id] = (chunk.start + 1, entries)
