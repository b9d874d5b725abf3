"""Scheduler: pure logic that turns the waiting and running requests into a StepPlan.

Per step, under a token budget of `max_num_batched_tokens`:
  1. running requests in decode (one token each) go first, most urgent first;
  2. then running requests still in prefill get a chunk of at most `prefill_chunk_size` tokens;
  3. then waiting requests are admitted in arrival order while the budget, `max_num_seqs` and pages last,
     starting from their longest cached prefix.
When a running request needs a page and none is left, the least urgent (lowest priority, then newest)
running request not yet scheduled this step is preempted: its pages are released (full ones stay in the
prefix cache) and it goes back to the front of the waiting queue to be recomputed.
No tensors and no device code here: unit tests drive it with a pool of a few pages.
"""
from __future__ import annotations

import itertools
from collections import deque

from dflash2.config import SchedulerConfig
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # insertion order = admission order
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        self.num_preemptions = 0

    # -- queue operations --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._order[request.request_id] = next(self._seq)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its pages."""
        if request.request_id in self.running:
            del self.running[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self._order.pop(request.request_id, None)
        request.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ----------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Choose this step's chunks; each scheduled request's computed mark moves past its chunk at once
        (the KV is in flight on the device), so the next plan can be made before this step has run."""
        plan = StepPlan()
        self._budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        ranked = sorted((r for r in self.running.values() if not r.finish_pending), key=self._urgency)
        decodes = [r for r in ranked if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in ranked if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if self._budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size,
                          self._budget)
            if self._make_room(request, num_new, scheduled, plan):
                chunk = self._chunk(request, num_new)
                scheduled[request.request_id] = chunk
                plan.chunks.append(chunk)
                self._budget -= num_new
        if not plan.preempted:
            self._admit(plan)
        for chunk in plan.chunks:
            self.running[chunk.request_id].num_computed_tokens = chunk.start + chunk.num_tokens
        return plan

    def on_step_done(self, plan: StepPlan) -> None:
        """Hash the pages the step filled (call once the step's input tokens are all known)."""
        for chunk in plan.chunks:
            request = self.running.get(chunk.request_id)
            if request is not None:  # else finished or aborted meanwhile
                self.kv.commit(request)

    # -- internals ---------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = 0
            if not self.kv.pages_of(request.request_id):
                cached = self.kv.attach_prefix(request)
                request.num_computed_tokens = cached
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size,
                          self._budget)
            if not self.kv.grow(request, request.num_computed_tokens + num_new):
                self.kv.free(request)
                request.num_computed_tokens = 0
                break
            self.kv.record_prefix_lookup(request.num_tokens, cached)
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            plan.chunks.append(self._chunk(request, num_new))
            self._budget -= num_new

    def _make_room(self, request: Request, num_new: int, scheduled: dict[str, ScheduledChunk],
                   plan: StepPlan) -> bool:
        """Grow the request's pages, preempting the least urgent running requests (itself included, and
        ones already given a chunk this step) until they fit; False if the request itself was preempted."""
        while not self.kv.grow(request, request.num_computed_tokens + num_new):
            rank = self._urgency(request)
            victim = max((r for r in self.running.values() if self._urgency(r) >= rank), key=self._urgency)
            dropped = scheduled.pop(victim.request_id, None)
            if dropped is not None:
                plan.chunks.remove(dropped)
                self._budget += dropped.num_tokens
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        del self.running[request.request_id]
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        new_pages_start, new_page_ids = self.kv.take_new_pages(request.request_id)
        return ScheduledChunk(
            request_id=request.request_id,
            start=start,
            token_ids=tuple(request.token_ids[start:end]),
            slot=self.kv.slot_of(request.request_id),
            new_pages_start=new_pages_start,
            new_page_ids=new_page_ids,
            sample=end == request.num_tokens,
            all_logits=request.wants_prompt_logprobs and start < request.num_prompt_tokens,
        )

    def _urgency(self, request: Request) -> tuple[int, int]:
        """Sort key: most urgent first (higher priority, then earlier arrival)."""
        return (-request.priority, self._order[request.request_id])
