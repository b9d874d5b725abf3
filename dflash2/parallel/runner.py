"""The runners of a parallel engine: rank 0's DriverRunner and every other rank's WorkerRunner, on one step plan.

    rank 0 (DriverRunner)                          rank r > 0 (WorkerRunner)
    Step(plan) ──control──────────────────────────► run_step: the same swaps, page table, flat batch
    forward (its stage; TP collectives) ◄─────────► forward (its stage; TP collectives; stages send / recv)
    logits (PP: received from the last stage) ◄──── the last stage's logits (PP: its first rank sends them)
    sample ──────── sampled tokens (broadcast) ───► future_tokens, at the same offset (placeholders resolve alike)
    prompt logits (PP = 1: gathered as the head's) ◄──► the same calls, in the same order

Every collective is called by every rank of its group in the same order: a worker repeats rank 0's step except
the sampling, and takes the sampled tokens instead. Each rank's page pool holds its own heads (and layers) of
the same page ids, so the plan's page ids and swap copies mean the same on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dflash2.engine.kv.layout import KVLayout
from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.engine.host_batch import HostBatch, order_chunks
from dflash2.engine.runner import ModelRunner, PendingStep, RunnerOptions, StepResult
from dflash2.engine.storage import PoolStorage
from dflash2.engine.transfer import to_device
from dflash2.loading.model_loader import LoadedModel
from dflash2.models.llama import ForwardContext
from dflash2.parallel.groups import RankGroups
from dflash2.parallel.messages import Step
from dflash2.request import Request

if TYPE_CHECKING:
    from dflash2.parallel.executor import Executor


def prompt_logit_rows(chunk: ScheduledChunk, num_prompt_tokens: int) -> int:
    """Rows of prompt logits a chunk asking for every position's gives (as ModelRunner._prompt_logprob_job)."""
    return min(chunk.start + chunk.num_tokens, num_prompt_tokens - 1) - chunk.start


def stage_forward(runner: ModelRunner, groups: RankGroups, host: HostBatch, num_decodes: int) -> torch.Tensor | None:
    """This rank's stage of the forward: the final hidden states on the last stage; None on the others (their
    activations sent on to the next stage)."""
    module = runner.model.module
    meta = runner._metadata(host, num_decodes)
    ctx = ForwardContext(positions=meta.positions, attention=meta, kv_caches=runner.kv_caches,
                         attention_backend=runner.attention)
    if groups.is_first_stage:
        token_ids = runner._resolve(to_device(host.token_ids, torch.long, runner.device), host.has_placeholders)
        if groups.is_last_stage:
            return module(token_ids, ctx)
        x, residual = module.embed_tokens(token_ids), None
    else:
        x, residual = groups.recv_activations(len(host.token_ids), runner.model.arch.hidden_size, runner.model.dtype)
    ctx.begin_forward()
    for layer in module.layers:
        x, residual = layer(x, residual, module.rotary, ctx)
    if not groups.is_last_stage:
        groups.send_activations(x, residual)
        return None
    return module.norm(residual) if x is None else module.norm(x, residual)[0]


class DriverRunner(ModelRunner):
    """Rank 0's runner: sends each step to the other ranks, runs its own part, samples, shares the tokens."""

    def __init__(self, model: LoadedModel, layout: KVLayout, num_pages: int, options: RunnerOptions,
                 storage: PoolStorage | None = None, *, executor: "Executor") -> None:
        super().__init__(model, layout, num_pages, options, storage)
        self.executor = executor
        self.groups = executor.groups
        self._prompt_rows: list[int] = []  # PP: rows of each prompt-logit piece of the step, in order
        self._prompt_logits: list[torch.Tensor] = []  # PP: those pieces, received from the last stage

    @torch.inference_mode()
    def launch(self, plan: StepPlan, requests: Mapping[str, Request]) -> PendingStep:
        lengths = {c.request_id: requests[c.request_id].num_prompt_tokens for c in plan.chunks if c.all_logits}
        with self.executor.step_failures():
            self.executor.send(Step(plan, lengths))
            if self.groups.pp_size > 1:
                ordered, _ = order_chunks(plan.chunks)
                rows = [prompt_logit_rows(c, lengths[c.request_id]) for c in ordered if c.all_logits]
                self._prompt_rows = [r for r in rows if r > 0]
            return super().launch(plan, requests)

    def collect(self, pending: PendingStep) -> StepResult:
        with self.executor.step_failures():
            return super().collect(pending)

    def forward_eager(self, host: HostBatch, num_decodes: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.groups.pp_size == 1:
            return super().forward_eager(host, num_decodes)
        stage_forward(self, self.groups, host, num_decodes)  # the first stage: its activations go on
        num_sampled = len(host.sample_rows)
        rows = num_sampled + sum(self._prompt_rows)
        if not rows:
            return None, None
        block = self.groups.recv_logits(rows, self.model.arch.vocab_size, self.model.dtype)
        self._prompt_logits = list(block[num_sampled:].split(self._prompt_rows)) if self._prompt_rows else []
        return None, (block[:num_sampled] if num_sampled else None)

    def _sample(self, logits: torch.Tensor | None, chunks: list[ScheduledChunk], requests: Mapping[str, Request],
                greedy: torch.Tensor | None = None) -> PendingStep:
        pending = super()._sample(logits, chunks, requests, greedy)
        if pending.placeholders:  # the tokens it put in future slots [base, base + n): the same slots everywhere
            base = -pending.placeholders[0] - 1
            self.groups.broadcast_tokens(self.future_tokens[base:base + len(chunks)])
        return pending

    def _prompt_logprob_job(self, chunk: ScheduledChunk, hidden: torch.Tensor | None, first_row: int,
                            request: Request) -> tuple | None:
        if self.groups.pp_size == 1:
            return super()._prompt_logprob_job(chunk, hidden, first_row, request)
        count = prompt_logit_rows(chunk, request.num_prompt_tokens)
        if count <= 0:
            return None
        logits = self._prompt_logits.pop(0)
        targets = request.prompt_token_ids[chunk.start + 1:chunk.start + 1 + count]
        return (chunk.request_id, chunk.start + 1, logits, targets, request.sampling_params.prompt_logprobs or 0)


class WorkerRunner(ModelRunner):
    """A rank other than 0: rank 0's steps on its own part of the model and its own pool, without sampling."""

    def __init__(self, model: LoadedModel, layout: KVLayout, num_pages: int, options: RunnerOptions,
                 groups: RankGroups) -> None:
        super().__init__(model, layout, num_pages, options)
        self.groups = groups

    def execute(self, plan: StepPlan, requests: Mapping[str, Any]) -> StepResult:
        """The profiling step (engine/memory.py): the step rank 0 sends for the same plan."""
        step = self.groups.receive_message()
        if not isinstance(step, Step):
            raise RuntimeError(f"rank {self.groups.rank} expected the profiling step, got {step!r}")
        self.run_step(step)
        return StepResult()

    @torch.inference_mode()
    def run_step(self, step: Step) -> None:
        plan = step.plan
        self.storage.swap(plan.swap_out, plan.swap_in)
        if not plan.chunks:
            return
        self.update_page_table(plan.chunks)
        ordered, num_decodes = order_chunks(plan.chunks)
        host = HostBatch.build(ordered, num_decodes)
        hidden = stage_forward(self, self.groups, host, num_decodes)
        num_sampled = len(host.sample_rows)
        if hidden is None:  # not the last stage
            self._receive_tokens(num_sampled)
            return
        head = self.model.module.compute_logits
        logits = head(hidden[host.sample_rows]) if num_sampled else None
        prompt = []
        for index, first_row in host.logit_chunks:
            chunk = ordered[index]
            rows = prompt_logit_rows(chunk, step.prompt_lengths[chunk.request_id])
            if rows > 0:
                prompt.append((first_row, rows))
        if self.groups.pp_size == 1:  # as rank 0: it samples (the tokens come), then computes the prompt logits
            self._receive_tokens(num_sampled)
            for first_row, rows in prompt:
                head(hidden[first_row:first_row + rows])
            return
        pieces = ([logits] if logits is not None else []) + [head(hidden[f:f + r]) for f, r in prompt]
        if pieces and self.groups.tp_rank == 0:
            self.groups.send_logits(torch.cat(pieces))
        self._receive_tokens(num_sampled)

    def _receive_tokens(self, count: int) -> None:
        """Rank 0's sampled tokens, into the future slots its _sample wrote (the same alternating halves)."""
        if not count:
            return
        base = self.future_base
        self.future_base = self.options.max_slots - base
        self.groups.broadcast_tokens(self.future_tokens[base:base + count])
