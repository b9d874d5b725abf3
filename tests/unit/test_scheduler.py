"""Scheduler: continuous batching, decode-first, chunked prefill, max_num_seqs, admission and preemption.

A fake engine drives it: `plan()`, then the plan's page copies and chunks applied to fake device and host
pages (each holding the tokens written into it), then `on_step_done(plan)`, then one fake token for every
chunk that samples, finishing requests at max_tokens. Chunks are compared as (request_id, start, num_tokens,
sample). After every operation: device free + cached + used == num_pages, host free + swapped == num_pages,
each page's refcount is the number of live tables holding it, a waiting (or swapped) request holds no
device page and no slot, and every running or swapped request's pages hold exactly its computed tokens.
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from dflash2.config import SchedulerConfig
from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.plan import StepPlan
from dflash2.engine.queues import WaitingQueue
from dflash2.engine.scheduler import Scheduler
from dflash2.request import Request, RequestStatus
from dflash2.sampling_params import SamplingParams

Chunk = tuple[str, int, int, bool]


class FakeEngine:
    """Drives the scheduler like the engine, and plays the runner: it mirrors the page-table rows from the
    plans, copies page contents for swap_out (device -> host) and swap_in (host -> device), reading every
    source before writing any destination, and writes
    each chunk's tokens into its pages, so that a lost or misplaced page shows up as wrong contents."""

    def __init__(self, num_pages: int, tokens_per_page: int, host_pages: int = 0,
                 clock: Callable[[], float] | None = None, l2: bool = False, **config: float) -> None:
        """`l2`: the host pages are also the L2 tier (as the engine makes them with swap space): cached pages the
        device evicts are copied down, and come back up on a prefix hit."""
        scheduler_config = SchedulerConfig(**config).with_device_defaults("cpu")
        self.pool = PagePool(num_pages, page_bytes=1)
        self.pool.keep_evicted = l2
        self.host_pool = HostPagePool(host_pages)  # 0 pages: every preemption recomputes
        # One page-table slot per running request, as the engine sizes it.
        self.kv = KVManager(self.pool, tokens_per_page, "m", max_slots=scheduler_config.max_num_seqs,
                            host_pool=self.host_pool)
        waiting = WaitingQueue(scheduler_config.priority_aging_seconds, clock=clock) if clock is not None else None
        self.scheduler = Scheduler(scheduler_config, self.kv, waiting)
        self.tokens_per_page = tokens_per_page
        self.rows: dict[int, list[int]] = {}  # slot -> page ids, as the runner's device table would hold
        self.pages: dict[str, tuple[int, ...]] = {}  # request id -> its whole table, for the last step
        self.device: list[list[int | None]] = [[None] * tokens_per_page for _ in range(num_pages)]
        self.host: list[list[int | None]] = [[None] * tokens_per_page for _ in range(host_pages)]
        self.host_of: dict[str, list[int]] = {}  # swapped request id -> its host pages, from the plans
        self.requests: dict[str, Request] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add(request)
            self.check()

    def finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.host_of.pop(request.request_id, None)
        self.check()
        self.check_contents()

    def step(self) -> StepPlan:
        """One engine step: plan, copy pages, run the chunks, commit, append a fake token where one samples."""
        scheduler = self.scheduler
        plan = scheduler.plan()
        self.check_plan(plan)
        self.apply_swaps(plan)
        self.check()
        assert len({c.slot for c in plan.chunks}) == len(plan.chunks)
        self.pages = {}
        for chunk in plan.chunks:
            request = scheduler.running[chunk.request_id]
            row = self.rows.setdefault(chunk.slot, [])
            assert chunk.new_pages_start <= len(row)
            row[chunk.new_pages_start:] = chunk.new_page_ids
            assert row == self.kv.pages_of(chunk.request_id)
            assert chunk.slot == self.kv.slot_of(chunk.request_id)
            self.pages[chunk.request_id] = tuple(row)
            assert chunk.token_ids == tuple(request.token_ids[chunk.start:chunk.start + chunk.num_tokens])
            assert len(row) == self.kv.num_pages_for(chunk.start + chunk.num_tokens)
            assert chunk.sample == (chunk.start + chunk.num_tokens == request.num_tokens)
            for position, token in enumerate(chunk.token_ids, chunk.start):  # the step writes the chunk's KV
                self.device[row[position // self.tokens_per_page]][position % self.tokens_per_page] = token
        self.check_contents()
        scheduler.on_step_done(plan)
        self.check()
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            request = scheduler.running[chunk.request_id]
            request.token_ids.append(1000 + request.num_tokens)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.finish(request, RequestStatus.FINISHED_LENGTH)
        self.check()
        self.check_contents()
        return plan

    def check_plan(self, plan: StepPlan) -> None:
        scheduled = {c.request_id for c in plan.chunks}
        assert len(scheduled) == len(plan.chunks)
        assert set(plan.swapped) <= set(plan.preempted) and not set(plan.preempted) & scheduled
        assert set(plan.resumed) <= scheduled and not set(plan.resumed) & set(plan.preempted)
        assert len(set(plan.preempted)) == len(plan.preempted)
        for request_id in plan.preempted:
            request = self.requests[request_id]
            assert request.status is RequestStatus.PREEMPTED and request in self.scheduler.waiting
            assert self.kv.is_swapped(request_id) == (request_id in plan.swapped)
            if request_id not in plan.swapped:
                assert request.num_computed_tokens == 0  # dropped: recomputed from its tokens
        for request_id in plan.resumed:
            assert not self.kv.is_swapped(request_id)

    def apply_swaps(self, plan: StepPlan) -> None:
        """The runner's page copies (all reads, then all writes); the pairs follow plan.resumed and plan.swapped."""
        resumed = 0
        for request_id in plan.resumed:
            host_pages = self.host_of.pop(request_id)
            pairs = [pair for pair in plan.swap_in if pair[0] in host_pages]
            resumed += len(pairs)
            assert [h for h, _ in pairs] == host_pages
            # The host pages come back to the head of its table, in order.
            assert [d for _, d in pairs] == self.kv.pages_of(request_id)[:len(host_pages)]
        assert resumed == len(plan.swap_in) or self.pool.keep_evicted  # the rest: prefix pages brought up (L2)
        index = 0
        for request_id in plan.swapped:
            count = self.kv.num_pages_for(self.requests[request_id].num_computed_tokens)
            pairs = plan.swap_out[index:index + count]
            index += count
            self.host_of[request_id] = [h for _, h in pairs]
        assert index == len(plan.swap_out) or self.pool.keep_evicted  # the rest: evicted pages copied down
        # Every source is read before any destination is written, as the runner does: a plan may free a host
        # page by a swap-in and hand it to a later swap-out, or free a device page by a swap-out and hand it
        # to a later swap-in, in either order.
        outs = [list(self.device[device_page]) for device_page, _ in plan.swap_out]
        ins = [list(self.host[host_page]) for host_page, _ in plan.swap_in]
        for (_, host_page), contents in zip(plan.swap_out, outs):
            self.host[host_page] = contents
        for (_, device_page), contents in zip(plan.swap_in, ins):
            self.device[device_page] = contents

    def check(self) -> None:
        pool = self.pool
        pool.check()
        assert pool.num_free + pool.num_cached + pool.num_used == pool.num_pages
        host_pool = self.host_pool
        host_pool.check()
        assert host_pool.num_free + host_pool.num_swapped + host_pool.num_cached == host_pool.num_pages
        # Each page's refcount is the number of live page tables that hold it.
        owners = [0] * pool.num_pages
        for request in self.scheduler.running.values():
            for page in self.kv.pages_of(request.request_id):
                owners[page] += 1
            assert not self.kv.is_swapped(request.request_id)
        assert owners == [pool.refcount(p) for p in range(pool.num_pages)]
        slots = [self.kv.slot_of(r) for r in self.scheduler.running]
        assert len(set(slots)) == len(slots) and all(0 <= s < self.kv.max_slots for s in slots)
        swapped = []
        for request in self.scheduler.waiting:
            assert self.kv.pages_of(request.request_id) == []
            assert not has_slot(self.kv, request.request_id)
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if self.kv.is_swapped(request.request_id):
                swapped.append(request.request_id)
                assert request.status is RequestStatus.PREEMPTED and request.num_computed_tokens > 0
            else:
                assert request.num_computed_tokens == 0
        assert self.kv.num_swapped_requests == len(swapped)
        # Host pages are held by swapped requests only, one owner each.
        assert sorted(swapped) == sorted(self.host_of)
        held = [p for pages in self.host_of.values() for p in pages]
        assert len(held) == len(set(held)) == host_pool.num_swapped

    def check_contents(self) -> None:
        """Every running request's pages hold its computed tokens; every swapped one's host pages do."""
        tpp = self.tokens_per_page
        for request_id, request in self.scheduler.running.items():
            pages = self.kv.pages_of(request_id)
            held = [self.device[pages[p // tpp]][p % tpp] for p in range(request.num_computed_tokens)]
            assert held == request.token_ids[:request.num_computed_tokens], request_id
        for request_id, host_pages in self.host_of.items():
            request = self.requests[request_id]
            held = [self.host[host_pages[p // tpp]][p % tpp] for p in range(request.num_computed_tokens)]
            assert held == request.token_ids[:request.num_computed_tokens], request_id

    @property
    def state(self) -> tuple[int, int, int]:
        return self.pool.num_free, self.pool.num_cached, self.pool.num_used

    @property
    def waiting(self) -> list[str]:
        return [r.request_id for r in self.scheduler.waiting]

    @property
    def running(self) -> list[str]:
        return list(self.scheduler.running)

    def run_to_completion(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        assert not self.scheduler.has_unfinished()
        assert self.pool.num_used == 0
        assert self.pool.num_free + self.pool.num_cached == self.pool.num_pages
        assert self.host_pool.num_swapped == 0 and self.host_of == {}


def has_slot(kv: KVManager, request_id: str) -> bool:
    try:
        kv.slot_of(request_id)
    except KeyError:
        return False
    return True


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int, priority: int = 0,
                 arrival_time: float | None = None) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival_time=arrival_time)


def chunks(plan: StepPlan) -> list[Chunk]:
    return [(c.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


def page_updates(plan: StepPlan) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(c.request_id, c.slot, c.new_pages_start, c.new_page_ids) for c in plan.chunks]


def test_single_request_prefills_then_decodes() -> None:
    engine = FakeEngine(8, 4)
    a = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=3)
    engine.add(a)
    assert engine.waiting == ["a"] and a.status is RequestStatus.WAITING

    plan = engine.step()
    assert chunks(plan) == [("a", 0, 6, True)]
    assert engine.pages == {"a": (0, 1)}
    assert not plan.chunks[0].is_decode and plan.preempted == []
    assert a.token_ids == [10, 11, 12, 13, 14, 15, 1006]
    assert (a.num_computed_tokens, a.status) == (6, RequestStatus.RUNNING)
    assert engine.running == ["a"] and engine.waiting == []

    plan = engine.step()
    assert chunks(plan) == [("a", 6, 1, True)]
    assert plan.chunks[0].token_ids == (1006,) and plan.chunks[0].is_decode
    assert engine.pages == {"a": (0, 1)}
    assert a.num_computed_tokens == 7

    plan = engine.step()
    assert chunks(plan) == [("a", 7, 1, True)]
    assert engine.pages == {"a": (0, 1)}
    assert a.output_token_ids == [1006, 1007, 1008]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert not engine.scheduler.has_unfinished()
    assert engine.kv.pages_of("a") == []
    assert engine.state == (6, 2, 0)  # both full pages (8 computed tokens) stay cached

    plan = engine.step()
    assert chunks(plan) == [] and not plan


def test_chunked_prefill_respects_chunk_size_and_token_budget() -> None:
    engine = FakeEngine(10, 4, max_num_batched_tokens=8, prefill_chunk_size=5)
    engine.add(
        make_request("a", list(range(10)), max_tokens=2),
        make_request("b", list(range(100, 107)), max_tokens=2),
        make_request("c", list(range(200, 203)), max_tokens=1))

    plan = engine.step()
    assert chunks(plan) == [("a", 0, 5, False), ("b", 0, 3, False)]  # b gets what the budget leaves
    assert engine.pages == {"a": (0, 1), "b": (2,)}
    assert engine.running == ["a", "b"] and engine.waiting == ["c"]

    plan = engine.step()
    assert chunks(plan) == [("a", 5, 5, True), ("b", 3, 3, False)]
    assert engine.pages == {"a": (0, 1, 3), "b": (2, 4)}
    assert engine.waiting == ["c"]  # no budget left to admit c

    plan = engine.step()
    # a decodes; b's last prompt token is a one-token step, scheduled with the decodes; c takes 3 of 6 left.
    assert chunks(plan) == [("a", 10, 1, True), ("b", 6, 1, True), ("c", 0, 3, True)]
    assert engine.pages == {"a": (0, 1, 3), "b": (2, 4), "c": (5,)}
    assert engine.running == ["b"]  # a hit max_tokens=2, c max_tokens=1

    plan = engine.step()
    assert chunks(plan) == [("b", 7, 1, True)]
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_prefill_chunks_of_several_running_requests_share_the_budget() -> None:
    engine = FakeEngine(10, 2, max_num_batched_tokens=5, prefill_chunk_size=3)
    engine.add(
        make_request("a", list(range(7)), max_tokens=1),
        make_request("b", list(range(100, 106)), max_tokens=1))
    assert chunks(engine.step()) == [("a", 0, 3, False), ("b", 0, 2, False)]
    assert chunks(engine.step()) == [("a", 3, 3, False), ("b", 2, 2, False)]
    assert chunks(engine.step()) == [("a", 6, 1, True), ("b", 4, 2, True)]
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_decodes_go_first_by_priority_then_a_new_prefill_takes_the_rest() -> None:
    engine = FakeEngine(10, 4, max_num_batched_tokens=6)
    engine.add(make_request("a", [1, 2, 3], max_tokens=3))
    assert chunks(engine.step()) == [("a", 0, 3, True)]
    engine.add(make_request("b", [4, 5, 6], max_tokens=3, priority=5))
    assert chunks(engine.step()) == [("a", 3, 1, True), ("b", 0, 3, True)]

    engine.add(make_request("c", list(range(20, 28)), max_tokens=1))
    plan = engine.step()
    # Both decodes first (b is more urgent than the older a), then c's prefill gets the 4 tokens left.
    assert chunks(plan) == [("b", 3, 1, True), ("a", 4, 1, True), ("c", 0, 4, False)]
    assert engine.pages == {"b": (1,), "a": (0, 2), "c": (3,)}
    assert engine.running == ["b", "c"]  # a reached max_tokens

    plan = engine.step()
    assert chunks(plan) == [("b", 4, 1, True), ("c", 4, 4, True)]
    assert engine.pages == {"b": (1, 2), "c": (3, 4)}  # a's unhashed tail page 2 went free, reused first
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_decodes_of_the_most_urgent_fill_the_budget_first() -> None:
    engine = FakeEngine(8, 2, max_num_batched_tokens=2)
    engine.add(make_request("a", [1], max_tokens=3))
    assert chunks(engine.step()) == [("a", 0, 1, True)]
    engine.add(make_request("b", [2], max_tokens=2, priority=5), make_request("c", [3], max_tokens=1))
    assert chunks(engine.step()) == [("a", 1, 1, True), ("b", 0, 1, True)]
    assert engine.waiting == ["c"]
    assert chunks(engine.step()) == [("b", 1, 1, True), ("a", 2, 1, True)]  # the budget is spent on decodes
    assert engine.waiting == ["c"]
    assert chunks(engine.step()) == [("c", 0, 1, True)]
    assert not engine.scheduler.has_unfinished()


def test_max_num_seqs_caps_running_requests() -> None:
    engine = FakeEngine(10, 2, max_num_seqs=2)
    engine.add(
        make_request("a", [1, 2], max_tokens=2),
        make_request("b", [3, 4], max_tokens=2),
        make_request("c", [5, 6], max_tokens=2))
    assert chunks(engine.step()) == [("a", 0, 2, True), ("b", 0, 2, True)]
    assert engine.running == ["a", "b"] and engine.waiting == ["c"]
    assert chunks(engine.step()) == [("a", 2, 1, True), ("b", 2, 1, True)]
    assert engine.running == [] and engine.waiting == ["c"]  # both finished after the step
    plan = engine.step()
    assert chunks(plan) == [("c", 0, 2, True)]
    assert engine.running == ["c"]
    assert chunks(engine.step()) == [("c", 2, 1, True)]
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_admission_stops_without_preempting_when_pages_run_out() -> None:
    engine = FakeEngine(4, 2)
    a = make_request("a", [0, 1, 2, 3], max_tokens=3)
    b = make_request("b", [100, 101, 102, 103, 104, 105], max_tokens=1)
    c = make_request("c", [200], max_tokens=1)
    engine.add(a, b, c)

    plan = engine.step()
    assert chunks(plan) == [("a", 0, 4, True)]
    assert engine.pages == {"a": (0, 1)}
    # b needs 3 pages and 2 are left: it stays at the head and c (which would fit) waits behind it.
    assert plan.preempted == [] and engine.scheduler.num_preemptions == 0
    assert engine.waiting == ["b", "c"]
    assert (b.num_computed_tokens, b.status) == (0, RequestStatus.WAITING)
    assert engine.kv.pages_of("b") == []
    assert engine.state == (2, 0, 2)

    plan = engine.step()
    assert chunks(plan) == [("a", 4, 1, True)]
    assert engine.pages == {"a": (0, 1, 2)}
    assert plan.preempted == [] and engine.waiting == ["b", "c"]

    plan = engine.step()
    assert chunks(plan) == [("a", 5, 1, True)]
    assert plan.preempted == [] and engine.waiting == ["b", "c"]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert engine.state == (1, 3, 0)  # a's 3 full pages are cached, released tail first

    plan = engine.step()
    # b takes the free page 3, then evicts a's tail (2) and middle (1); c evicts a's first page (0).
    assert chunks(plan) == [("b", 0, 6, True), ("c", 0, 1, True)]
    assert engine.pages == {"b": (3, 2, 1), "c": (0,)}
    assert engine.pool.num_evictions == 3
    assert engine.scheduler.num_preemptions == 0
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_preemption_picks_lowest_priority_then_newest_and_requeues_at_the_front() -> None:
    engine = FakeEngine(4, 2)
    a = make_request("a", [10, 11], max_tokens=2)
    b = make_request("b", [20, 21], max_tokens=2)
    c = make_request("c", [30, 31], max_tokens=2)
    d = make_request("d", [40, 41], max_tokens=2, priority=7)  # the fourth to arrive, but the most urgent
    e = make_request("e", [50, 51], max_tokens=2)
    engine.add(a, b, c, d, e)
    assert engine.waiting == ["d", "a", "b", "c", "e"]  # priority, then arrival

    plan = engine.step()
    assert chunks(plan) == [("d", 0, 2, True), ("a", 0, 2, True), ("b", 0, 2, True), ("c", 0, 2, True)]
    assert engine.pages == {"d": (0,), "a": (1,), "b": (2,), "c": (3,)}
    # e does not fit and outranks nobody: it waits, and nobody is paused for it.
    assert plan.preempted == [] and engine.waiting == ["e"]

    plan = engine.step()
    # d decodes first and needs a page: c is the most recently admitted of the lowest priority. Then a
    # needs one: of the requests no more urgent than a, b is the most recently admitted.
    assert plan.preempted == ["c", "b"] and plan.swapped == []  # no host pages: both are recomputed
    assert chunks(plan) == [("d", 2, 1, True), ("a", 2, 1, True)]
    assert engine.pages == {"d": (0, 3), "a": (1, 2)}  # each takes the victim's page, evicting it
    assert engine.scheduler.num_preemptions == 2
    for victim in (b, c):
        assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (
            RequestStatus.PREEMPTED, 0, 1)
        assert victim.num_tokens == 3  # its generated token is kept, to be recomputed
    assert engine.waiting == ["b", "c", "e"]  # the victims keep their places in line, ahead of e
    assert engine.running == []  # a and d finished after the step
    assert engine.state == (2, 2, 0)  # d's and a's full first pages are cached, their tails free

    plan = engine.step()
    assert plan.preempted == []
    assert chunks(plan) == [("b", 0, 3, True), ("c", 0, 3, True)]  # their pages were evicted: no prefix hit
    assert engine.pages == {"b": (2, 3), "c": (0, 1)}  # the free pages, then the cached ones, oldest first
    assert engine.waiting == ["e"]
    assert (b.status, c.status) == (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_LENGTH)
    assert engine.pool.num_evictions == 4

    assert chunks(engine.step()) == [("e", 0, 2, True)]
    assert chunks(engine.step()) == [("e", 2, 1, True)]
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_admission_in_the_step_that_preempted_for_pages() -> None:
    engine = FakeEngine(2, 2, host_pages=2)
    a = make_request("a", [1, 2], max_tokens=3, priority=1)
    b = make_request("b", [3, 4], max_tokens=3)
    engine.add(a, b)
    assert chunks(engine.step()) == [("a", 0, 2, True), ("b", 0, 2, True)]
    c = make_request("c", [5], max_tokens=1, priority=9)
    engine.add(c)
    plan = engine.step()
    # a's decode needs a page: b (less urgent) is paused to host page 0 and a grows into b's page 1. Then c,
    # which outranks a, finds no page left and pauses a in the same plan: a's decode is dropped, its one
    # computed page goes to host page 1, and c is admitted at once into page 1 (copied out first).
    assert plan.preempted == ["b", "a"] and plan.swapped == ["b", "a"]
    assert plan.swap_out == [(1, 0), (0, 1)] and plan.swap_in == []
    assert chunks(plan) == [("c", 0, 1, True)]
    assert engine.pages == {"c": (1,)}
    assert (a.num_computed_tokens, b.num_computed_tokens) == (2, 2)
    assert engine.waiting == ["a", "b"]  # priority, then arrival: a ahead of b
    assert c.status is RequestStatus.FINISHED_LENGTH
    assert engine.state == (1, 1, 0) and (engine.host_pool.num_free, engine.host_pool.num_swapped) == (0, 2)

    plan = engine.step()
    # a resumes from host page 1 (no recomputation); b would need 2 more pages and waits.
    assert plan.resumed == ["a"] and plan.swap_in == [(1, 1)] and plan.preempted == []
    assert chunks(plan) == [("a", 2, 1, True)]
    assert engine.pages == {"a": (1, 0)}
    assert chunks(engine.step()) == [("a", 3, 1, True)]
    plan = engine.step()
    assert plan.resumed == ["b"] and plan.swap_in == [(0, 0)]
    assert chunks(plan) == [("b", 2, 1, True)]
    engine.run_to_completion()
    assert (a.num_preemptions, b.num_preemptions, engine.scheduler.num_swap_outs) == (1, 1, 2)


def test_a_request_paused_in_a_step_is_not_resumed_in_it_and_holds_the_line() -> None:
    engine = FakeEngine(4, 2, host_pages=4)
    x = make_request("x", [1, 2, 3, 4], max_tokens=2)
    y = make_request("y", [5, 6, 7], max_tokens=2)
    engine.add(x, y)
    assert chunks(engine.step()) == [("x", 0, 4, True), ("y", 0, 3, True)]
    assert engine.pages == {"x": (0, 1), "y": (2, 3)}
    z = make_request("z", [9], max_tokens=1)
    engine.add(z)
    plan = engine.step()
    # y decodes within its pages; x needs a third page and pauses y (equal priority, admitted later),
    # dropping y's decode. One of y's pages is left free, but y, paused in this plan, does not come back
    # in it, and z, behind y in line, does not jump it.
    assert plan.preempted == ["y"] and plan.swapped == ["y"] and plan.swap_out == [(2, 0), (3, 1)]
    assert chunks(plan) == [("x", 4, 1, True)]
    assert plan.resumed == [] and engine.waiting == ["y", "z"]
    assert engine.state == (1, 3, 0)  # x finished after the step: its pages stay cached
    plan = engine.step()
    assert plan.resumed == ["y"] and chunks(plan) == [("y", 3, 1, True), ("z", 0, 1, True)]
    engine.run_to_completion()


def self_preemption_setup() -> tuple[FakeEngine, Request, Request, StepPlan]:
    engine = FakeEngine(3, 2)
    a = make_request("a", [10, 11, 12], max_tokens=2, priority=5)
    b = make_request("b", [20, 21], max_tokens=3)
    engine.add(a, b)
    plan = engine.step()
    assert chunks(plan) == [("a", 0, 3, True), ("b", 0, 2, True)]
    assert engine.pages == {"a": (0, 1), "b": (2,)}
    plan = engine.step()
    return engine, a, b, plan


def test_a_request_preempts_itself_when_it_is_the_least_urgent() -> None:
    engine, a, b, plan = self_preemption_setup()
    # a decodes within its pages; b needs a second page, none is left, and only b itself is unscheduled.
    assert chunks(plan) == [("a", 3, 1, True)]
    assert plan.preempted == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.token_ids == [20, 21, 1002]
    assert engine.kv.pages_of("b") == []
    assert engine.waiting == ["b"]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert engine.state == (0, 3, 0)  # b's prompt page and a's two pages are all cached


def test_a_preempted_request_reuses_its_cached_pages_on_resume() -> None:
    engine, a, b, plan = self_preemption_setup()
    assert plan.preempted == ["b"]
    plan = engine.step()
    # b's full prompt page (2) stayed cached: it resumes at token 2 and only computes its generated token.
    assert chunks(plan) == [("b", 2, 1, True)]
    assert engine.pages == {"b": (2, 1)}  # the new page evicts the oldest cached one: a's tail (1)
    assert [(c.new_pages_start, c.new_page_ids) for c in plan.chunks] == [(0, (2, 1))]  # a fresh table
    assert engine.kv.num_prefix_hits == 2
    assert b.num_cached_tokens == 0  # it counts prompt tokens served at the first admission only
    assert engine.pool.num_evictions == 1

    assert chunks(engine.step()) == [("b", 3, 1, True)]
    assert b.output_token_ids == [1002, 1003, 1004]
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_a_preempted_request_recomputes_prompt_and_generated_tokens() -> None:
    engine = FakeEngine(2, 4, prefill_chunk_size=2)
    u = make_request("u", [10, 11, 12, 13], max_tokens=3, priority=9)
    v = make_request("v", [20, 21], max_tokens=3)
    engine.add(u, v)

    assert chunks(engine.step()) == [("u", 0, 2, False), ("v", 0, 2, True)]
    assert chunks(engine.step()) == [("v", 2, 1, True), ("u", 2, 2, True)]  # decodes go first

    plan = engine.step()
    assert plan.preempted == ["v"]  # u needs a second page; v holds no full page, so nothing is cached
    assert chunks(plan) == [("u", 4, 1, True)]
    assert engine.pages == {"u": (0, 1)}
    assert v.token_ids == [20, 21, 1002, 1003]
    assert (v.num_computed_tokens, v.status) == (0, RequestStatus.PREEMPTED)

    plan = engine.step()
    assert chunks(plan) == [("u", 5, 1, True)]  # v does not fit until u finishes
    assert engine.waiting == ["v"] and plan.preempted == []

    plan = engine.step()
    assert chunks(plan) == [("v", 0, 2, False)]  # prompt and generated tokens again, in chunks
    assert plan.chunks[0].token_ids == (20, 21)
    plan = engine.step()
    assert chunks(plan) == [("v", 2, 2, True)]  # only the chunk that ends at the last token samples
    assert plan.chunks[0].token_ids == (1002, 1003)
    assert v.output_token_ids == [1002, 1003, 1004]
    assert v.status is RequestStatus.FINISHED_LENGTH
    assert (v.num_preemptions, engine.scheduler.num_preemptions) == (1, 1)
    assert not engine.scheduler.has_unfinished()
    assert engine.pool.num_used == 0


def test_each_chunk_carries_only_the_pages_added_since_the_last_one() -> None:
    engine = FakeEngine(8, 2, max_num_seqs=2)
    engine.add(make_request("a", [1, 2, 3], max_tokens=4), make_request("b", [4], max_tokens=1))
    plan = engine.step()
    assert page_updates(plan) == [("a", 0, 0, (0, 1)), ("b", 1, 0, (2,))]
    engine.add(make_request("c", [5, 6], max_tokens=2))
    plan = engine.step()
    # a's fourth token still fits in page 1; c takes the slot b left and starts its row from 0.
    assert page_updates(plan) == [("a", 0, 2, ()), ("c", 1, 0, (2,))]
    plan = engine.step()
    assert page_updates(plan) == [("a", 0, 2, (3,)), ("c", 1, 1, (4,))]
    assert engine.pages == {"a": (0, 1, 3), "c": (2, 4)}
    plan = engine.step()
    assert page_updates(plan) == [("a", 0, 3, ())]
    engine.run_to_completion()


def test_a_more_urgent_prefill_preempts_a_less_urgent_decode_scheduled_before_it() -> None:
    # Equal priorities: the earlier admitted is the more urgent, but a decode is scheduled before a prefill.
    engine = FakeEngine(4, 2, prefill_chunk_size=3)
    old = make_request("old", [20, 21, 22, 23, 24, 25], max_tokens=1)
    new = make_request("new", [10, 11, 12], max_tokens=5)
    engine.add(old, new)
    plan = engine.step()
    assert chunks(plan) == [("old", 0, 3, False), ("new", 0, 3, True)]
    assert engine.pages == {"old": (0, 1), "new": (2, 3)}

    plan = engine.step()
    # new's decode fits in its pages and is planned first; old needs a third page and none is free.
    # The least urgent running request is new (admitted last): it is preempted and its chunk dropped.
    assert plan.preempted == ["new"]
    assert chunks(plan) == [("old", 3, 3, True)]
    assert engine.pages == {"old": (0, 1, 3)}  # new's partly filled page went free and old took it
    assert old.status is RequestStatus.FINISHED_LENGTH
    assert engine.waiting == ["new"] and new.num_computed_tokens == 0
    plan = engine.step()
    assert chunks(plan) == [("new", 2, 2, True)]  # its prompt page 2 stayed cached
    engine.run_to_completion()


def test_running_decodes_go_first_then_prefills_each_by_priority_then_admission() -> None:
    engine = FakeEngine(12, 2, prefill_chunk_size=2)
    low = make_request("low", [1, 2, 3, 4, 5], max_tokens=3)
    low_decode = make_request("low_decode", [6], max_tokens=3)
    high = make_request("high", [7, 8, 9, 10, 11], max_tokens=1, priority=9)
    engine.add(low, low_decode, high)
    assert chunks(engine.step()) == [("high", 0, 2, False), ("low", 0, 2, False), ("low_decode", 0, 1, True)]
    # Every decode (one token each) before any prefill chunk; then the prefills, most urgent first.
    assert chunks(engine.step()) == [
        ("low_decode", 1, 1, True), ("high", 2, 2, False), ("low", 2, 2, False)]
    # low's last prompt token is a one-token step too: equal priority, both decode, low was admitted first.
    assert chunks(engine.step()) == [
        ("high", 4, 1, True), ("low", 4, 1, True), ("low_decode", 2, 1, True)]
    engine.run_to_completion()


def test_finish_of_a_waiting_request_removes_it() -> None:
    engine = FakeEngine(2, 2)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=1)
    b = make_request("b", [6], max_tokens=1)
    engine.add(a, b)
    assert chunks(engine.step()) == []  # a needs 3 pages of 2
    engine.scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    engine.check()
    assert engine.waiting == ["b"] and a.status is RequestStatus.FINISHED_ABORTED
    assert chunks(engine.step()) == [("b", 0, 1, True)]
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("host_pages", [0, 4])
def test_every_request_finishes_under_memory_pressure(host_pages: int) -> None:
    rng = random.Random(0)
    engine = FakeEngine(10, 2, host_pages=host_pages, max_num_batched_tokens=7, prefill_chunk_size=3,
                        max_num_seqs=4)
    shared = [7, 7, 7, 7]
    requests = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(100) for _ in range(rng.randint(1, 6))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 8),
                                     priority=rng.choice([0, 0, 100, 1000])))
    pending = list(requests)
    for num_steps in range(1, 300):
        if pending and num_steps % 2:
            engine.add(pending.pop(0))
        plan = engine.step()
        assert plan.num_tokens <= 7
        assert len(engine.scheduler.running) <= 4
        assert all(c.num_tokens <= 3 for c in plan.chunks)
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        assert not set(plan.preempted) & {c.request_id for c in plan.chunks}
        if not pending and not engine.scheduler.has_unfinished():
            break
    assert not engine.scheduler.has_unfinished()
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == request.sampling_params.max_tokens
    assert engine.scheduler.num_preemptions > 0 and engine.kv.num_prefix_hits > 0
    assert (engine.scheduler.num_swap_outs > 0) == (host_pages > 0)
    pool = engine.pool
    assert pool.num_used == 0
    assert pool.num_free + pool.num_cached == pool.num_pages
    assert engine.host_pool.num_swapped == 0 and engine.kv.num_swapped_requests == 0


# -- the host tier (L2) ------------------------------------------------------------------------------------
def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory():
    """Four device pages of 2 tokens: a's 6-token prompt is cached when it ends, b and c evict it (copied down
    to host pages instead of lost), and d with a's prompt gets it back from there: 4 tokens reused, its pages'
    contents right (check_contents), only its last tokens computed."""
    engine = FakeEngine(4, 2, host_pages=8, l2=True)
    prompt = [1, 2, 3, 4, 5, 6]
    engine.add(make_request("a", prompt, max_tokens=1))
    while engine.running or engine.waiting:
        engine.step()
    assert engine.pool.num_cached == 3  # 3 full pages of a's tokens
    engine.add(make_request("b", [20, 21, 22, 23, 24], max_tokens=1), make_request("c", [30, 31, 32], max_tokens=1))
    plans = []
    while engine.running or engine.waiting:
        plans.append(engine.step())
    assert engine.host_pool.num_cached >= 2 and sum(len(p.swap_out) for p in plans) >= engine.host_pool.num_cached
    d = make_request("d", prompt + [7], max_tokens=1)
    engine.add(d)
    plan = engine.step()
    hits = len(plan.swap_in)
    assert hits >= 2 and d.num_cached_tokens == 6
    assert [c.start for c in plan.chunks] == [6]  # only the new token computed
    assert engine.kv.num_prefix_hits_host == 2 * hits
    while engine.running or engine.waiting:
        engine.step()
