"""Scheduler: pure logic that turns the waiting and running requests into a StepPlan.

Per step, under a token budget of `max_num_batched_tokens`, in this order:
  1. running decodes (one token each), most urgent first (priority, then admission order);
  2. running prefill chunks, most urgent first; before each one, the waiting requests that outrank it
     (effective priority, strictly higher) are admitted with their first chunk, so an urgent arrival's
     prompt (up to `prefill_chunk_size`) goes in the very next step, ahead of less urgent prefills;
  3. the other waiting requests, in the WaitingQueue's order (effective priority, then arrival), while the
     budget, `max_num_seqs` and pages last.
  A swapped request is admitted by getting its pages back (swap in); a new one starts from its longest
  cached prefix. Admission stops at the first waiting request that cannot be admitted (nobody behind it
  jumps the line) and at a request paused in this very plan (it resumes in a later step).

      budget: [ decodes | urgent waiting | prefill p=100 | waiting p=100 > p=0 | prefill p=0 | rest ]

  While a request of the top priority present (waiting, or running with prompt left) exists, the prefill
  chunks of requests it outranks by `preemption_threshold` share at most `max_outranked_prefill_tokens`
  tokens per step, so that the urgent request's steps stay short.
Preemption, least urgent first (lowest priority, then most recently admitted):
  - pages run out for a running request: a running request no more urgent than it is paused;
  - a waiting request cannot be admitted (pages, max_num_seqs or budget): running requests outranked by
    at least `preemption_threshold` are paused until it fits, and it is admitted in the same step.
A paused request's computed KV goes to host pages when the swap pool has room (it resumes where it
stopped, no recomputation) or is dropped (recomputed from its prompt and outputs, helped by the prefix
cache). It goes back to waiting with its original arrival, so it keeps its place in line.

Several models share one page pool: each has its own Scheduler, and each knows the others as `peers`.
Preemption crosses models: a waiting request may pause the peers' running requests it outranks by
`preemption_threshold`, and a running one that needs a page may pause theirs that it outranks so; their swap
copies go into this model's plan (the pool's bytes are shared). Admission numbers come from one counter shared
by the peers, so "most recently admitted" compares across models.
No tensors and no device code here: unit tests drive it with a pool of a few pages.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from dflash2.config import SchedulerConfig
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.engine.queues import WaitingQueue
from dflash2.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, waiting: WaitingQueue | None = None,
                 admissions: Iterator[int] | None = None) -> None:
        """`admissions`: the admission counter, shared by the schedulers of models on one pool."""
        if not config.sizes_chosen:
            raise ValueError("the scheduler needs its batch sizes chosen (SchedulerConfig.with_device_defaults)")
        self.config = config
        self.kv = kv
        self.waiting = waiting if waiting is not None else WaitingQueue(config.priority_aging_seconds)
        self.running: dict[str, Request] = {}
        self.peers: list[Scheduler] = []  # the other models' schedulers on the same pool (the engine sets them)
        self._arrivals = itertools.count()
        self._admissions = admissions if admissions is not None else itertools.count()
        self._admitted: dict[str, int] = {}  # request id -> admission number (most recent start)
        self._arrival: dict[str, int] = {}  # request id -> arrival number (its place in line)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.swapped_bytes = 0  # bytes copied to host pages so far

    # -- queue operations --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._arrival[request.request_id] = next(self._arrivals)
        self.waiting.add(request, self._arrival[request.request_id])

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its pages (device and host)."""
        if request.request_id in self.running:
            del self.running[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        if self.kv.disk is not None:
            self.kv.disk.forget_fetch(request.request_id)
        self._admitted.pop(request.request_id, None)
        self._arrival.pop(request.request_id, None)
        request.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def top_priority(self, now: float) -> float | None:
        """The effective priority of this model's most urgent request, waiting or running (None: none)."""
        top = None
        head = self.waiting.head()
        if head is not None:
            top = self.waiting.effective_priority(head, now)
        for request in self.running.values():
            if not request.finish_pending:
                effective = self.waiting.effective_priority(request, now)
                if top is None or effective > top:
                    top = effective
        return top

    # -- planning ----------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Choose this step's chunks; each scheduled request's computed mark moves past its chunk at once
        (the KV is in flight on the device), so the next plan can be made before this step has run."""
        plan = StepPlan()
        self._start_plan()
        ranked = sorted((r for r in self.running.values() if not r.finish_pending), key=self._running_rank)
        for request in ranked:  # 1. decodes
            if not _is_prefill(request):
                self._run_decode(request, plan)
        for request in ranked:  # 2. prefills, each after the waiting requests that outrank it
            if _is_prefill(request):
                self._admit(plan, above=self._effective(request))
                self._run(request, plan)
        self._admit(plan)  # 3. the rest of the line
        for chunk in plan.chunks:
            self.running[chunk.request_id].num_computed_tokens = chunk.start + chunk.num_tokens
        self._demote_evicted(plan)
        return plan

    def _demote_evicted(self, plan: StepPlan) -> None:
        """Cached device pages this plan evicted go down to host memory (the L2 tier) instead of being lost: a
        copy before the step's kernels write them (swap_out), where the host tier has room.

        When the device pool runs short of free pages, its least recently used cached pages go down ahead of
        need, a batch at a time, so that the copies come in few, larger swaps instead of a few pages every step
        (a swap costs ~0.2 ms of host time whatever its size: W3 on the H100)."""
        pool, host_pool = self.kv.pool, self.kv.host_pool
        if host_pool is None or not pool.keep_evicted:
            return
        evicted = pool.take_evicted()
        batch = max(1, min(64, pool.num_pages // 32))
        if pool.num_free < batch and pool.num_cached:
            room = host_pool.num_free + host_pool.num_evictable
            evicted += pool.evict(min(2 * batch - pool.num_free, room))
        if not evicted:
            return
        host_pages = host_pool.store([(content_hash, owner) for _, content_hash, owner in evicted])
        plan.swap_out.extend((page, host_page) for (page, _, _), host_page in zip(evicted, host_pages)
                             if host_page is not None)

    def _start_plan(self) -> None:
        self._budget = self.config.max_num_batched_tokens
        self._scheduled: dict[str, ScheduledChunk] = {}
        self._admitted_now: set[str] = set()  # admitted in this plan: never paused again in it
        self._preempted_now: set[str] = set()  # paused in this plan: not admitted again in it
        self._admission_closed = False
        self._now = self.waiting.clock()
        self._order: Iterable[Request] | None = self.waiting.ordered()  # the line; taken again when one joins
        # The outranked-prefill cap: who is on top, and what is left of it this step.
        self._outranked_from: float | None = None
        self._cap_left = self.config.max_outranked_prefill_tokens
        self._charged: dict[str, int] = {}  # request id -> tokens of its chunk counted against the cap
        if self._cap_left is not None:
            head = self.waiting.head()
            contenders = ([head] if head is not None else []) + [r for r in self.running.values() if _is_prefill(r)]
            if contenders:  # the line's head is its most urgent request
                top = max(self._effective(r) for r in contenders)
                self._outranked_from = top - self.config.preemption_threshold

    def _run(self, request: Request, plan: StepPlan) -> None:
        """Give a running request its next chunk, if budget (and the cap) leave it one."""
        if self._budget == 0 or request.status is not RequestStatus.RUNNING:
            return  # out of budget, or paused earlier in this plan
        num_new = self._chunk_size(request)
        if num_new > 0 and self._make_room(request, num_new, plan):
            self._schedule(request, num_new, plan)

    def _run_decode(self, request: Request, plan: StepPlan) -> None:
        """_run for a request with one token to compute (the common case: a step may hold hundreds), without the
        chunk-size and cap checks that only prefills need."""
        start = request.num_computed_tokens
        if self._budget == 0 or request.status is not RequestStatus.RUNNING or request.num_tokens <= start:
            return
        if self._make_room(request, 1, plan):
            self._add(self._chunk(request, 1), plan)

    def on_step_done(self, plan: StepPlan) -> None:
        """Hash the pages the step filled (call once the step's input tokens are all known)."""
        for chunk in plan.chunks:
            request = self.running.get(chunk.request_id)
            if request is not None:  # else finished or aborted meanwhile
                self.kv.commit(request)

    # -- admission ---------------------------------------------------------------------------------
    def _admit(self, plan: StepPlan, above: float | None = None) -> None:
        """Admit waiting requests in line order (only those ranked above `above`, if given)."""
        if self._admission_closed:
            return
        if self._order is None:
            self._order = self.waiting.ordered()
        for request in self._order:
            if request not in self.waiting:
                continue  # admitted earlier in this plan
            if above is not None and self._effective(request) <= above:
                return  # the running prefill goes first; the line goes on after it
            if request.request_id in self._preempted_now or self._cap_blocks(request):
                break
            if self._reading_from_disk(request):
                continue  # its pages come up from disk meanwhile; the line goes on
            if self._try_admit(request, plan):
                continue
            if not self._preempt_for(request, plan) or not self._try_admit(request, plan):
                break  # the most urgent waiting request does not fit: nobody behind it jumps the line
        self._admission_closed = True

    def _reading_from_disk(self, request: Request) -> bool:
        """Whether a waiting request's prefix goes on into disk pages (L3) that are being read up to host memory
        (it waits for them, at most until its fetch's deadline), starting those reads when loading them is
        expected to be faster than computing their tokens."""
        disk, kv = self.kv.disk, self.kv
        if disk is None or kv.pages_of(request.request_id) or kv.is_swapped(request.request_id):
            return False
        hit = kv.lookup_prefix(request, with_disk=True)
        if not hit.disk or not disk.worth_loading(len(hit.disk), len(hit.disk) * kv.tokens_per_page):
            return False
        return disk.fetch(request.request_id, kv.namespace, hit.disk, self._now)

    def _try_admit(self, request: Request, plan: StepPlan) -> bool:
        if self._budget == 0 or len(self.running) >= self.config.max_num_seqs:
            return False
        request_id = request.request_id
        swapped = self.kv.is_swapped(request_id)
        cached = 0
        if swapped:
            num_new = self._chunk_size(request)
            needed = self.kv.num_pages_for(request.num_computed_tokens + num_new)
            if needed > self.kv.num_available:
                return False
            pairs = self.kv.swap_in(request)
            self.kv.grow(request, request.num_computed_tokens + num_new)
        else:
            if not self.kv.pages_of(request_id):
                cached, promoted = self.kv.attach_prefix(request)
                plan.swap_in.extend(promoted)  # whatever comes next: those device pages now hold that prefix
                request.num_computed_tokens = cached
            num_new = self._chunk_size(request)
            if not self.kv.grow(request, request.num_computed_tokens + num_new):
                self.kv.free(request)
                request.num_computed_tokens = 0
                return False
        if swapped:
            plan.swap_in.extend(pairs)
            plan.resumed.append(request_id)
        else:
            self._record_prefix(request, cached)
        self._leave_line(request)
        self._admitted_now.add(request_id)
        self._schedule(request, num_new, plan)
        return True

    def _record_prefix(self, request: Request, cached: int) -> None:
        """Count a new admission's prefix lookup; its first admission's hit is the request's cached tokens."""
        self.kv.record_prefix_lookup(request.num_tokens, cached)
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached

    def _leave_line(self, request: Request) -> None:
        """The waiting request starts running."""
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request
        self._admitted[request.request_id] = next(self._admissions)

    def _preempt_for(self, request: Request, plan: StepPlan) -> bool:
        """Pause running requests outranked by the waiting `request` until it fits; False if it cannot.

        Both sides are ranked by effective priority (aging counts for running requests too, from their
        arrival), so an aged request, once admitted, is not paused again by newer urgent ones.
        """
        effective = self.waiting.effective_priority
        bar = effective(request) - self.config.preemption_threshold
        victims = [r for r in self.running.values() if r.request_id not in self._admitted_now and effective(r) <= bar]
        for peer in self.peers:
            victims += [r for r in peer.running.values() if effective(r) <= bar]
        victims.sort(key=lambda r: (effective(r), -self._admission_of(r)))
        if not victims or not self._could_fit(request, victims):
            return False  # pausing every candidate would still not make room: pause nobody
        for victim in victims:
            self._preempt(victim, plan)
            if self._fits(request):
                return True
        return self._fits(request)

    def _pages_needed(self, request: Request) -> int:
        if self.kv.is_swapped(request.request_id):
            return self.kv.num_pages_for(request.num_tokens)
        return self.kv.pages_needed(request, min(request.num_tokens, self.config.prefill_chunk_size))

    def _could_fit(self, request: Request, victims: list[Request]) -> bool:
        pages = self.kv.num_available + sum(len(self._owner_of(v).kv.pages_of(v.request_id)) for v in victims)
        budget = self._budget + sum(self._scheduled[v.request_id].num_tokens
                                    for v in victims if v.request_id in self._scheduled)
        return self._pages_needed(request) <= pages and budget > 0

    def _fits(self, request: Request) -> bool:
        if self._budget == 0 or len(self.running) >= self.config.max_num_seqs:
            return False
        return self._pages_needed(request) <= self.kv.num_available

    # -- running requests --------------------------------------------------------------------------
    def _make_room(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Grow the request's pages, pausing the least urgent running requests (itself included, and
        ones already given a chunk this step) until they fit; False if the request itself was paused."""
        while not self.kv.grow(request, request.num_computed_tokens + num_new):
            rank = self._victim_rank(request)
            victim = min((r for r in self.running.values() if self._victim_rank(r) <= rank
                          and r.request_id not in self._admitted_now), key=self._victim_rank)
            bar = request.priority - self.config.preemption_threshold
            for peer in self.peers:  # another model's requests it outranks by the threshold go first
                outranked = [r for r in peer.running.values() if r.priority <= bar]
                if outranked:
                    victim = min([victim, *outranked], key=self._victim_rank)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _owner_of(self, request: Request) -> "Scheduler":
        if request.request_id in self.running or not self.peers:
            return self
        return next((peer for peer in self.peers if request.request_id in peer.running), self)

    def _admission_of(self, request: Request) -> int:
        return self._owner_of(request)._admitted[request.request_id]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        owner = self._owner_of(request)
        if owner is not self:  # another model's request: its pages come free for this plan
            owner.pause(request, plan)
            return
        request_id = request.request_id
        dropped = self._scheduled.pop(request_id, None)
        if dropped is not None:
            plan.chunks.remove(dropped)
            self._budget += dropped.num_tokens
            self._cap_left_add(self._charged.pop(request_id, 0))
        self._preempted_now.add(request_id)
        self._order = None  # it rejoins the line
        self.pause(request, plan)

    def pause(self, request: Request, plan: StepPlan) -> None:
        """Send a running request back to waiting, its KV swapped to host pages (the copies go in `plan`, which
        may be another model's: the pool's bytes are shared) or dropped."""
        request_id = request.request_id
        del self.running[request_id]
        self._admitted.pop(request_id, None)
        pairs = self.kv.swap_out(request)
        if pairs is not None:
            plan.swap_out.extend(pairs)
            plan.swapped.append(request_id)
            self.num_swap_outs += 1
            self.swapped_bytes += len(pairs) * self.kv.pool.page_bytes
        else:
            self._spill_for(request)
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.add(request, self._arrival[request_id])  # its original place in line
        plan.preempted.append(request_id)
        self.num_preemptions += 1

    def _spill_for(self, request: Request) -> None:
        """Host memory had no room for a paused request's pages: with a disk tier, the swapped requests furthest
        back in line hand their full pages to the prefix cache, written to disk (L3) and then evictable, until
        they cover this request's pages. This one is dropped now (its full pages stay in the device's prefix
        cache); the pages coming down from the device find room in host memory once those writes are in."""
        kv = self.kv
        if kv.disk is None or kv.disk.store.writes_disabled or kv.host_pool is None:
            return
        needed = kv.num_pages_for(request.num_computed_tokens)
        swapped = [r for r in self.waiting.ordered() if kv.is_swapped(r.request_id) and not r.wants_prompt_logprobs]
        for victim in reversed(swapped):
            if needed <= 0:
                break
            pages = kv.spill(victim)
            kv.disk.write_spilled(pages)
            needed -= len(pages)

    def _schedule(self, request: Request, num_new: int, plan: StepPlan) -> None:
        self._add(self._chunk(request, num_new), plan)
        if _is_prefill(request) and self._capped(request):
            self._charged[request.request_id] = num_new
            self._cap_left_add(-num_new)

    def _add(self, chunk: ScheduledChunk, plan: StepPlan) -> None:
        self._scheduled[chunk.request_id] = chunk
        plan.chunks.append(chunk)
        self._budget -= chunk.num_tokens

    def _chunk_size(self, request: Request) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size, self._budget)
        if _is_prefill(request) and self._capped(request):
            num_new = min(num_new, self._cap_left)
        return num_new

    # -- the outranked-prefill cap -----------------------------------------------------------------
    def _effective(self, request: Request) -> float:
        return self.waiting.effective_priority(request, self._now)

    def _outranked(self, request: Request) -> bool:
        """Whether the top request present (waiting, or with prompt left) outranks this one in this plan."""
        return self._outranked_from is not None and self._effective(request) <= self._outranked_from

    def _capped(self, request: Request) -> bool:
        """Whether the request's prefill chunks count against the cap in this plan."""
        return self._cap_left is not None and self._outranked(request)

    def _cap_blocks(self, request: Request) -> bool:
        """A waiting request the cap leaves no prefill tokens this step (it waits, and so does the line
        behind it)."""
        return self._cap_left == 0 and _is_prefill(request) and self._capped(request)

    def _cap_left_add(self, num_tokens: int) -> None:
        if self._cap_left is not None:
            self._cap_left += num_tokens

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        request_id = request.request_id
        new_pages_start, new_page_ids = self.kv.take_new_pages(request_id)
        # positional: this runs for every request of every step
        return ScheduledChunk(request_id, start, tuple(request.token_ids[start:end]), self.kv.slot_of(request_id),
                              new_pages_start, new_page_ids, end == len(request.token_ids),
                              request.wants_prompt_logprobs and start < request.num_prompt_tokens)

    def _running_rank(self, request: Request) -> tuple[int, bool, int]:
        """Most urgent first: higher priority, then decodes before prefills, then earlier admission."""
        return (-request.priority, _is_prefill(request), self._admitted[request.request_id])

    def _victim_rank(self, request: Request) -> tuple[int, int]:
        """Least urgent first: lower priority, then more recently admitted."""
        return (request.priority, -self._admission_of(request))


def _is_prefill(request: Request) -> bool:
    """More than one token to compute: a prompt (or recomputation) not yet done."""
    return request.num_tokens - request.num_computed_tokens > 1
