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
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        ranked = sorted(self.running.values(), key=self._urgency)
        decodes = [r for r in ranked if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in ranked if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size, budget)
            if self._make_room(request, num_new, scheduled, plan):
                plan.chunks.append(self._chunk(request, num_new))
                scheduled.add(request.request_id)
                budget -= num_new
        if not plan.preempted:
            budget = self._admit(plan, budget)
        return plan

    def on_step_done(self, plan: StepPlan) -> None:
        """Advance each scheduled request's computed mark and hash the pages it filled."""
        for chunk in plan.chunks:
            request = self.running.get(chunk.request_id)
            if request is None:
                continue  # finished or aborted during the step
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.commit(request)

    # -- internals ---------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.kv.pages_of(request.request_id):
                cached = self.kv.attach_prefix(request)
                request.num_computed_tokens = cached
                if request.num_preemptions == 0:
                    request.num_cached_tokens = cached
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size, budget)
            if not self.kv.grow(request, request.num_computed_tokens + num_new):
                self.kv.free(request)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return budget

    def _make_room(self, request: Request, num_new: int, scheduled: set[str], plan: StepPlan) -> bool:
        """Grow the request's pages, preempting less urgent requests as needed; False if it was preempted."""
        while not self.kv.grow(request, request.num_computed_tokens + num_new):
            candidates = [r for r in self.running.values() if r.request_id not in scheduled]
            victim = max(candidates, key=self._urgency)
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
        return ScheduledChunk(
            request_id=request.request_id,
            start=start,
            token_ids=tuple(request.token_ids[start:end]),
            page_ids=tuple(self.kv.pages_of(request.request_id)),
            sample=end == request.num_tokens,
            all_logits=request.wants_prompt_logprobs and start < request.num_prompt_tokens,
        )

    def _urgency(self, request: Request) -> tuple[int, int]:
        """Sort key: most urgent first (higher priority, then earlier arrival)."""
        return (-request.priority, self._order[request.request_id])
