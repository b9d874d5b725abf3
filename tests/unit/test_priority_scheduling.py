"""Priority scheduling: preemption for urgent arrivals, swap to host pages and back, keeping one's place in
line, the preemption threshold, aging.

Driven by test_scheduler.py's FakeEngine, which plays the runner: it copies page contents for every
(device, host) pair of `plan.swap_out` and then every (host, device) pair of `plan.swap_in`, writes each
chunk's tokens into its pages, and checks after every operation that device free + cached + used == total,
host free + swapped == total, a waiting or swapped request holds no device page and no slot, and every
running or swapped request's pages hold exactly its computed tokens. Pools are 4-12 pages of 2-4 tokens.
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from dflash2.config import SchedulerConfig
from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.queues import WaitingQueue
from dflash2.engine.scheduler import Scheduler
from dflash2.request import RequestStatus
from tests.unit.test_scheduler import FakeEngine, chunks, make_request, page_updates


def host_state(engine: FakeEngine) -> tuple[int, int]:
    engine.host_pool.check()
    return engine.host_pool.num_free, engine.host_pool.num_swapped


# -- an urgent arrival pauses the least urgent running requests and is admitted in the same step ----------
def test_an_urgent_arrival_pauses_the_least_urgent_request_when_max_num_seqs_is_full() -> None:
    engine = FakeEngine(8, 2, host_pages=4, max_num_seqs=2)
    a = make_request("a", [10, 11, 12], max_tokens=4)
    b = make_request("b", [20, 21], max_tokens=4, priority=5)
    engine.add(a, b)
    assert chunks(engine.step()) == [("b", 0, 2, True), ("a", 0, 3, True)]
    assert engine.pages == {"b": (0,), "a": (1, 2)}

    u = make_request("u", [30, 31, 32], max_tokens=2, priority=9)
    engine.add(u)
    assert engine.waiting == ["u"]
    plan = engine.step()
    # Both running requests decode first; u finds max_num_seqs full and pauses a (priority 0 < 5): a's
    # decode is dropped and its 2 computed pages go to host pages 0 and 1 before the step's kernels run.
    assert plan.preempted == ["a"] and plan.swapped == ["a"] and plan.resumed == []
    assert plan.swap_out == [(1, 0), (2, 1)] and plan.swap_in == []
    assert chunks(plan) == [("b", 2, 1, True), ("u", 0, 3, True)]
    assert engine.pages == {"b": (0, 3), "u": (2, 4)}  # u may reuse a's page 2: it is copied out first
    assert page_updates(plan)[1] == ("u", 1, 0, (2, 4))  # u takes the slot a left
    assert (a.status, a.num_computed_tokens, a.num_preemptions) == (RequestStatus.PREEMPTED, 3, 1)
    assert engine.kv.is_swapped("a") and engine.kv.pages_of("a") == []
    assert engine.waiting == ["a"] and engine.running == ["b", "u"]
    assert engine.state == (3, 1, 4) and host_state(engine) == (2, 2)
    assert (engine.scheduler.num_preemptions, engine.scheduler.num_swap_outs, engine.scheduler.swapped_bytes) == (
        1, 1, 2)

    plan = engine.step()
    assert chunks(plan) == [("u", 3, 1, True), ("b", 3, 1, True)]
    assert plan.preempted == [] and plan.resumed == [] and engine.waiting == ["a"]  # a outranks nobody

    plan = engine.step()
    # u finished: a comes back from host pages 0 and 1 into new device pages, with no recomputation.
    assert plan.resumed == ["a"] and plan.swap_in == [(0, 6), (1, 7)] and plan.swap_out == []
    assert chunks(plan) == [("b", 4, 1, True), ("a", 3, 1, True)]
    assert engine.pages == {"b": (0, 3, 5), "a": (6, 7)}
    assert page_updates(plan)[1] == ("a", 1, 0, (6, 7))  # a fresh row in the slot it was given
    assert host_state(engine) == (4, 0) and engine.kv.num_swapped_requests == 0
    assert a.status is RequestStatus.RUNNING

    engine.run_to_completion()
    assert a.output_token_ids == [1003, 1004, 1005, 1006]
    assert engine.kv.num_prefix_hits == 0 and engine.scheduler.num_preemptions == 1


def test_an_urgent_arrival_pauses_lowest_priority_then_most_recent_when_pages_run_out() -> None:
    engine = FakeEngine(5, 4, host_pages=4)
    a = make_request("a", [10, 11], max_tokens=4)
    b = make_request("b", [20, 21], max_tokens=4, priority=5)
    c = make_request("c", [30, 31], max_tokens=4)
    d = make_request("d", [40, 41], max_tokens=4, priority=5)
    engine.add(a, b, c, d)
    assert chunks(engine.step()) == [("b", 0, 2, True), ("d", 0, 2, True), ("a", 0, 2, True), ("c", 0, 2, True)]
    e = make_request("e", [50, 51], max_tokens=3, priority=3)  # admitted last, but not the least urgent
    engine.add(e)
    engine.step()
    assert engine.pages == {"b": (0,), "d": (1,), "a": (2,), "c": (3,), "e": (4,)}
    assert engine.state == (0, 0, 5)

    u = make_request("u", [60, 61, 62, 63, 64, 65], max_tokens=1, priority=9)  # needs 2 pages
    engine.add(u)
    plan = engine.step()
    # Least urgent first: priority 0 before e's 3, and of those c (admitted after a) first.
    assert plan.preempted == ["c", "a"] and plan.swapped == ["c", "a"]
    assert plan.swap_out == [(3, 0), (2, 1)]
    assert chunks(plan) == [("b", 3, 1, True), ("d", 3, 1, True), ("e", 2, 1, True), ("u", 0, 6, True)]
    assert engine.pages["u"] == (2, 3)
    assert (a.num_computed_tokens, c.num_computed_tokens) == (3, 3)
    assert engine.waiting == ["a", "c"]  # arrival order, not the order they were paused in
    assert engine.state == (1, 1, 3) and host_state(engine) == (2, 2)

    plan = engine.step()
    assert chunks(plan) == [("b", 4, 1, True), ("d", 4, 1, True), ("e", 3, 1, True)]
    assert plan.preempted == [] and plan.resumed == []  # no page left for a: it outranks nobody
    assert engine.waiting == ["a", "c"] and engine.running == []

    plan = engine.step()
    assert plan.resumed == ["a", "c"] and plan.swap_in == [(1, 2), (0, 3)]
    assert chunks(plan) == [("a", 3, 1, True), ("c", 3, 1, True)]  # where each stopped
    assert engine.pages == {"a": (2,), "c": (3,)}
    assert host_state(engine) == (4, 0)
    engine.run_to_completion()
    assert engine.scheduler.num_swap_outs == 2 and engine.scheduler.swapped_bytes == 2


def test_an_urgent_arrival_goes_ahead_of_a_less_urgent_prefill_chunk() -> None:
    engine = FakeEngine(12, 2, host_pages=4, max_num_batched_tokens=4, prefill_chunk_size=4)
    a = make_request("a", list(range(10, 20)), max_tokens=2)
    engine.add(a)
    assert chunks(engine.step()) == [("a", 0, 4, False)]

    u = make_request("u", [30, 31, 32], max_tokens=2, priority=9)
    engine.add(u)
    plan = engine.step()
    # u outranks a's prefill: its whole prompt goes first, a's chunk gets the one token left. Nobody is paused.
    assert chunks(plan) == [("u", 0, 3, True), ("a", 4, 1, False)]
    assert plan.preempted == [] and plan.swap_out == []
    assert engine.pages == {"u": (2, 3), "a": (0, 1, 4)}
    assert engine.state == (7, 0, 5) and host_state(engine) == (4, 0)

    plan = engine.step()
    assert chunks(plan) == [("u", 3, 1, True), ("a", 5, 3, False)]  # u's decode first, a the rest
    assert chunks(engine.step()) == [("a", 8, 2, True)]
    engine.run_to_completion()
    assert engine.scheduler.num_preemptions == 0


def order_setup(cap: int | None) -> FakeEngine:
    """Running: d decoding (priority 0), p100 and p0 prefilling; waiting: u (1000), w100, w50."""
    engine = FakeEngine(40, 4, max_num_batched_tokens=16, prefill_chunk_size=4, max_outranked_prefill_tokens=None)
    engine.add(make_request("d", [1], max_tokens=8))
    engine.step()
    engine.add(make_request("p100", list(range(100, 112)), max_tokens=1, priority=100),
               make_request("p0", list(range(200, 212)), max_tokens=1))
    plan = engine.step()
    assert chunks(plan) == [("d", 1, 1, True), ("p100", 0, 4, False), ("p0", 0, 4, False)]
    engine.add(make_request("w50", [50, 51, 52], max_tokens=2, priority=50),
               make_request("w100", [60, 61, 62], max_tokens=2, priority=100),
               make_request("u", [70, 71, 72, 73], max_tokens=2, priority=1000))
    assert engine.waiting == ["u", "w100", "w50"]
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_outranked_prefill_tokens=cap)
    return engine


def test_the_budget_goes_to_decodes_then_waiting_requests_ahead_of_the_prefills_they_outrank() -> None:
    engine = order_setup(cap=None)
    plan = engine.step()
    # Decodes; u ahead of p100 (it outranks it); p100 (w100 does not outrank it: equal priority, running
    # first); w100 and w50 ahead of p0, which gets the one token left.
    assert chunks(plan) == [("d", 2, 1, True), ("u", 0, 4, True), ("p100", 4, 4, False), ("w100", 0, 3, True),
                            ("w50", 0, 3, True), ("p0", 4, 1, False)]
    assert plan.num_tokens == 16 and plan.preempted == []
    assert engine.waiting == [] and engine.scheduler.num_preemptions == 0
    engine.run_to_completion()


def test_an_urgent_request_caps_the_prefill_chunks_it_outranks() -> None:
    engine = order_setup(cap=2)
    plan = engine.step()
    # u is on top: every prefill it outranks shares 2 tokens. p100 takes both; w100 gets none and is not
    # admitted, and w50 does not jump it; p0 gets none either.
    assert chunks(plan) == [("d", 2, 1, True), ("u", 0, 4, True), ("p100", 4, 2, False)]
    assert engine.waiting == ["w100", "w50"] and plan.preempted == []

    plan = engine.step()
    # u's prompt is done (decodes go most urgent first): now p100 and w100 (priority 100) are on top, and
    # cap the prefills below 100: w50 gets 2 tokens, p0 none.
    assert chunks(plan) == [("u", 4, 1, True), ("d", 3, 1, True), ("p100", 6, 4, False), ("w100", 0, 3, True),
                            ("w50", 0, 2, False)]
    assert engine.waiting == [] and engine.running == ["d", "p100", "p0", "w100", "w50"]  # u finished
    plan = engine.step()
    # p100's last chunk still caps p0; w50's last prompt token is one token, not a capped prefill chunk.
    assert chunks(plan) == [("w100", 3, 1, True), ("w50", 2, 1, True), ("d", 4, 1, True), ("p100", 10, 2, True),
                            ("p0", 4, 2, False)]
    assert chunks(engine.step()) == [("w50", 3, 1, True), ("d", 5, 1, True), ("p0", 6, 4, False)]  # nobody above p0
    engine.run_to_completion()


def test_equal_priorities_are_never_capped() -> None:
    engine = FakeEngine(40, 4, max_num_batched_tokens=16, prefill_chunk_size=8, max_outranked_prefill_tokens=0)
    engine.add(make_request("a", list(range(12)), max_tokens=1), make_request("b", list(range(20, 32)), max_tokens=1))
    assert chunks(engine.step()) == [("a", 0, 8, False), ("b", 0, 8, False)]
    assert chunks(engine.step()) == [("a", 8, 4, True), ("b", 8, 4, True)]


@pytest.mark.parametrize("seed", [464, 1848])
def test_a_page_freed_by_one_copy_may_be_the_destination_of_another_in_the_same_step(seed: int) -> None:
    # Random load (these seeds produce such plans): a swap-in frees a host page that a later swap-out in the
    # same plan takes, so the copies must read every source before writing any destination (FakeEngine
    # does, like the runner; copying out first would hand the resumed request the paused one's KV).
    rng = random.Random(seed)
    t = [0.0]
    aging = rng.choice([None, 5.0])
    engine = FakeEngine(rng.randint(6, 10), 2, host_pages=rng.randint(1, 6), clock=lambda: t[0],
                        max_num_seqs=rng.randint(2, 4), max_num_batched_tokens=rng.randint(4, 10),
                        prefill_chunk_size=rng.randint(2, 4), priority_aging_seconds=aging,
                        max_outranked_prefill_tokens=rng.choice([None, 0, 2]))
    pending = [make_request(f"r{i}", [rng.randrange(100) for _ in range(rng.randint(1, 6))],
                            max_tokens=rng.randint(1, 6), priority=rng.choice([0, 0, 5, 9])) for i in range(10)]
    overlaps = 0
    for _ in range(300):
        t[0] += 1
        if pending and rng.random() < 0.5:
            request = pending.pop(0)
            request.arrival_time = t[0]
            engine.add(request)
        plan = engine.step()  # checks every page's contents after the copies
        overlaps += bool({h for h, _ in plan.swap_in} & {h for _, h in plan.swap_out})
        if not pending and not engine.scheduler.has_unfinished():
            break
    assert overlaps > 0, "the load no longer produces the case: pick another seed"
    engine.run_to_completion()


@pytest.mark.parametrize("threshold", [1, 3, 4])
def test_the_preemption_threshold_is_the_least_priority_gap_that_preempts(threshold: int) -> None:
    engine = FakeEngine(8, 2, host_pages=4, max_num_seqs=1, preemption_threshold=threshold)
    a = make_request("a", [10, 11], max_tokens=3, priority=2)
    engine.add(a)
    assert chunks(engine.step()) == [("a", 0, 2, True)]
    u = make_request("u", [30, 31], max_tokens=1, priority=5)  # 3 above a
    engine.add(u)
    plan = engine.step()
    if threshold <= 3:
        assert plan.preempted == ["a"] and plan.swapped == ["a"] and plan.swap_out == [(0, 0)]
        assert chunks(plan) == [("u", 0, 2, True)]
        assert engine.waiting == ["a"] and a.num_computed_tokens == 2
        plan = engine.step()
        assert plan.resumed == ["a"] and plan.swap_in == [(0, 2)]
        assert chunks(plan) == [("a", 2, 1, True)]
    else:
        assert plan.preempted == [] and plan.swap_out == []
        assert chunks(plan) == [("a", 2, 1, True)]
        assert engine.waiting == ["u"] and engine.running == ["a"]
        assert chunks(engine.step()) == [("a", 3, 1, True)]
        assert chunks(engine.step()) == [("u", 0, 2, True)]
    engine.run_to_completion()
    assert engine.scheduler.num_preemptions == (1 if threshold <= 3 else 0)


def test_equal_priorities_never_preempt_for_admission() -> None:
    engine = FakeEngine(8, 2, host_pages=4, max_num_seqs=1)
    engine.add(make_request("a", [10, 11], max_tokens=2, priority=7))
    engine.step()
    engine.add(make_request("b", [20, 21], max_tokens=1, priority=7))
    plan = engine.step()
    assert plan.preempted == [] and chunks(plan) == [("a", 2, 1, True)]
    assert chunks(engine.step()) == [("b", 0, 2, True)]
    engine.run_to_completion()


# -- resuming: no recomputation, in order, keeping one's place in line -------------------------------------
def test_paused_requests_resume_by_priority_then_arrival_ahead_of_later_arrivals() -> None:
    engine = FakeEngine(6, 2, host_pages=6, max_num_seqs=3)
    p = make_request("p", [10, 11, 12], max_tokens=3, priority=2)
    q = make_request("q", [20, 21, 22], max_tokens=3)
    r = make_request("r", [30, 31, 32], max_tokens=3, priority=2)
    engine.add(p, q, r)
    assert chunks(engine.step()) == [("p", 0, 3, True), ("r", 0, 3, True), ("q", 0, 3, True)]
    assert engine.pages == {"p": (0, 1), "r": (2, 3), "q": (4, 5)}

    u = make_request("u", list(range(40, 52)), max_tokens=1, priority=9)  # needs every page
    engine.add(u)
    plan = engine.step()
    assert plan.preempted == ["q", "r", "p"] and plan.swapped == ["q", "r", "p"]
    assert plan.swap_out == [(4, 0), (5, 1), (2, 2), (3, 3), (0, 4), (1, 5)]
    assert chunks(plan) == [("u", 0, 12, True)]
    assert engine.pages == {"u": (1, 3, 5, 4, 2, 0)}  # free pages first, then cached ones, oldest first
    assert engine.waiting == ["p", "r", "q"]
    assert [x.num_computed_tokens for x in (p, q, r)] == [3, 3, 3]
    assert host_state(engine) == (0, 6) and engine.state == (0, 6, 0)

    s = make_request("s", [60, 61, 62], max_tokens=1, priority=2)  # arrives after p and r, same priority
    engine.add(s)
    assert engine.waiting == ["p", "r", "s", "q"]
    plan = engine.step()
    # max_num_seqs=3: p and r resume where they stopped, s is admitted, q (lowest priority) waits.
    assert plan.resumed == ["p", "r"] and plan.preempted == []
    assert plan.swap_in == [(4, 0), (5, 2), (2, 4), (3, 5)]
    assert chunks(plan) == [("p", 3, 1, True), ("r", 3, 1, True), ("s", 0, 3, True)]
    assert engine.pages == {"p": (0, 2), "r": (4, 5), "s": (3, 1)}
    assert engine.waiting == ["q"] and host_state(engine) == (4, 2)

    assert chunks(engine.step()) == [("p", 4, 1, True), ("r", 4, 1, True)]
    plan = engine.step()
    assert plan.resumed == ["q"] and plan.swap_in == [(0, 3), (1, 1)]
    assert chunks(plan) == [("q", 3, 1, True)]
    engine.run_to_completion()
    for x in (p, q, r):
        assert x.num_preemptions == 1 and x.output_token_ids == [1003, 1004, 1005]
    assert engine.kv.num_prefix_hits == 0  # nothing was recomputed from the prefix cache either


def test_a_request_short_of_pages_pauses_itself_and_resumes_from_host_pages() -> None:
    engine = FakeEngine(3, 2, host_pages=2)
    a = make_request("a", [10, 11, 12], max_tokens=2, priority=5)
    b = make_request("b", [20, 21], max_tokens=3)
    engine.add(a, b)
    assert chunks(engine.step()) == [("a", 0, 3, True), ("b", 0, 2, True)]
    plan = engine.step()
    # b needs a second page and only a (more urgent) holds pages: b pauses itself, to host page 0.
    assert plan.preempted == ["b"] and plan.swapped == ["b"] and plan.swap_out == [(2, 0)]
    assert chunks(plan) == [("a", 3, 1, True)]
    assert (b.status, b.num_computed_tokens) == (RequestStatus.PREEMPTED, 2)
    assert engine.state == (0, 3, 0) and host_state(engine) == (1, 1)
    plan = engine.step()
    assert plan.resumed == ["b"] and plan.swap_in == [(0, 2)]
    assert chunks(plan) == [("b", 2, 1, True)]
    assert engine.pages == {"b": (2, 1)}
    engine.run_to_completion()
    assert b.output_token_ids == [1002, 1003, 1004]


def test_a_full_host_pool_falls_back_to_recompute() -> None:
    engine = FakeEngine(6, 2, host_pages=2, max_num_seqs=2)
    a = make_request("a", [10, 11, 12, 13, 14], max_tokens=2)
    b = make_request("b", [20, 21], max_tokens=3)
    engine.add(a, b)
    assert chunks(engine.step()) == [("a", 0, 5, True), ("b", 0, 2, True)]
    assert engine.pages == {"a": (0, 1, 2), "b": (3,)}

    u = make_request("u", list(range(30, 37)), max_tokens=1, priority=9)  # needs 4 pages
    engine.add(u)
    plan = engine.step()
    # b (admitted last) goes first and fits in the host pool; a's 3 computed pages do not fit in the one
    # host page left, so its KV is dropped: it is recomputed, its 2 full pages kept in the prefix cache.
    assert plan.preempted == ["b", "a"] and plan.swapped == ["b"] and plan.swap_out == [(3, 0)]
    assert chunks(plan) == [("u", 0, 7, True)]
    assert engine.pages == {"u": (2, 4, 5, 3)}
    assert (a.status, a.num_computed_tokens, engine.kv.is_swapped("a")) == (RequestStatus.PREEMPTED, 0, False)
    assert (b.num_computed_tokens, engine.kv.is_swapped("b")) == (2, True)
    assert engine.waiting == ["a", "b"]
    assert host_state(engine) == (1, 1) and engine.state == (1, 5, 0)

    plan = engine.step()
    # a recomputes from its cached prompt pages (tokens 0-3); b comes back from host page 0.
    assert plan.resumed == ["b"] and plan.swap_in == [(0, 5)]
    assert chunks(plan) == [("a", 4, 2, True), ("b", 2, 1, True)]
    assert engine.pages == {"a": (0, 1, 3), "b": (5, 4)}
    assert engine.kv.num_prefix_hits == 4
    engine.run_to_completion()
    assert engine.scheduler.num_swap_outs == 1 and engine.scheduler.num_preemptions == 2


def test_without_a_host_pool_a_paused_request_is_recomputed() -> None:
    pool = PagePool(4, 1)
    kv = KVManager(pool, 2, "m", max_slots=1)  # host_pool=None: --swap-space 0
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1).with_device_defaults("cpu"), kv)
    a = make_request("a", [10, 11, 12], max_tokens=3)
    scheduler.add(a)
    scheduler.plan()
    scheduler.add(make_request("u", [20], max_tokens=1, priority=9))
    plan = scheduler.plan()
    assert plan.preempted == ["a"] and plan.swapped == [] and plan.swap_out == []
    assert [(c.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("u", 0, 1)]
    assert (a.num_computed_tokens, kv.is_swapped("a")) == (0, False)
    pool.check()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_finishing_a_swapped_request_releases_its_host_pages(status: RequestStatus) -> None:
    engine = FakeEngine(6, 2, host_pages=4, max_num_seqs=1)
    a = make_request("a", [10, 11, 12], max_tokens=4)
    engine.add(a)
    engine.step()
    engine.add(make_request("u", [20, 21], max_tokens=2, priority=9))
    plan = engine.step()
    assert plan.swapped == ["a"] and plan.swap_out == [(0, 0), (1, 1)]
    assert host_state(engine) == (2, 2) and engine.state == (4, 1, 1)

    engine.finish(a, status)
    assert a.status is status and not engine.kv.is_swapped("a")
    assert host_state(engine) == (4, 0) and engine.state == (4, 1, 1)  # device pages untouched
    assert engine.waiting == [] and engine.kv.num_swapped_requests == 0
    plan = engine.step()
    assert chunks(plan) == [("u", 2, 1, True)] and plan.swap_in == [] and plan.resumed == []
    engine.run_to_completion()


# -- aging ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aging", [None, 10.0])
def test_aging_admits_a_long_waiting_request_ahead_of_newer_urgent_ones(aging: float | None) -> None:
    t = [1.0]
    # A threshold above any priority gap: only the admission order is under test here.
    engine = FakeEngine(8, 2, clock=lambda: t[0], max_num_seqs=1, priority_aging_seconds=aging,
                        preemption_threshold=10**6)
    low = make_request("low", [1], max_tokens=1, arrival_time=0.0)
    h1 = make_request("h1", [2], max_tokens=1, priority=1000, arrival_time=0.1)
    h2 = make_request("h2", [3], max_tokens=1, priority=1000, arrival_time=0.2)
    h3 = make_request("h3", [4], max_tokens=1, priority=1000, arrival_time=0.5)
    engine.add(low, h1, h2, h3)
    # 10 s of waiting is worth the whole priority range (65536): 1000 is worth about 0.15 s. low arrived
    # 0.1 s before h1 (not enough) and 0.2 s before h2 (enough).
    queue = engine.scheduler.waiting
    assert queue.effective_priority(low) == (0.0 if aging is None else pytest.approx(6553.6))
    expected = ["h1", "h2", "h3", "low"] if aging is None else ["h1", "low", "h2", "h3"]
    assert engine.waiting == expected
    admitted = []
    while engine.scheduler.has_unfinished():
        plan = engine.step()
        assert plan.preempted == []
        admitted += [c.request_id for c in plan.chunks]
    assert admitted == expected


def test_aging_lets_every_low_priority_request_finish_under_a_stream_of_urgent_ones() -> None:
    def run(aging: float | None) -> list[bool]:
        t = [0.0]
        engine = FakeEngine(8, 2, host_pages=8, clock=lambda: t[0], max_num_seqs=2, max_num_batched_tokens=8,
                            priority_aging_seconds=aging, preemption_threshold=10**6)
        engine.add(*(make_request(f"first{i}", [90 + i], max_tokens=3, priority=1000, arrival_time=0.0)
                     for i in range(2)))
        lows = [make_request(f"low{i}", [i, i + 1, i + 2], max_tokens=3, arrival_time=0.0) for i in range(3)]
        engine.add(*lows)
        for step in range(40):  # one urgent arrival per step: 3 steps of work each, 2 seqs: overload
            engine.add(make_request(f"high{step}", [100 + step, 101 + step], max_tokens=3, priority=1000,
                                    arrival_time=t[0]))
            engine.step()
            t[0] += 1.0
        assert len(engine.waiting) > 10  # the urgent backlog keeps growing
        return [low.status is RequestStatus.FINISHED_LENGTH for low in lows]

    assert run(None) == [False, False, False]  # starved
    assert run(20.0) == [True, True, True]


def test_the_waiting_queue_orders_by_effective_priority_then_arrival_number() -> None:
    t = [100.0]
    queue = WaitingQueue(10.0, clock=lambda: t[0])
    a = make_request("a", [1], max_tokens=1, priority=5, arrival_time=100.0)
    b = make_request("b", [1], max_tokens=1, priority=5, arrival_time=100.0)
    c = make_request("c", [1], max_tokens=1, priority=6, arrival_time=100.0)
    queue.add(b, 7)
    queue.add(a, 3)  # a paused request put back keeps its (earlier) arrival number
    queue.add(c, 9)
    assert [r.request_id for r in queue] == ["c", "a", "b"] and len(queue) == 3 and a in queue
    t[0] = 200.0  # equal waits: aging keeps the order
    assert [r.request_id for r in queue.ordered()] == ["c", "a", "b"]
    queue.remove(c)
    assert [r.request_id for r in queue] == ["a", "b"] and c not in queue


@pytest.mark.parametrize("aging", [None, 0.5, 7.0])
def test_the_kept_line_matches_a_full_sort_by_effective_priority_as_requests_come_and_go(aging) -> None:
    rng = random.Random(5)
    t = [100.0]
    queue = WaitingQueue(aging, clock=lambda: t[0])
    present: list = []
    numbers = rng.sample(range(10_000), 400)  # arrival numbers are unique; a paused request keeps its old one
    for i in range(400):
        t[0] += rng.choice([0.0, 0.01, 0.3])
        if present and rng.random() < 0.4:
            queue.remove(present.pop(rng.randrange(len(present))))
        else:
            request = make_request(f"r{i}", [1], max_tokens=1, priority=rng.choice([0, 0, 100, 1000]),
                                   arrival_time=t[0] - rng.choice([0.0, 0.0, 2.0]))
            queue.add(request, numbers[i])
            present.append(request)
        expected = sorted(present, key=lambda r: (-queue.effective_priority(r, t[0]), queue.arrival(r)))
        assert [r.request_id for r in queue.ordered()] == [r.request_id for r in expected]


# -- bugs ------------------------------------------------------------------------------------------------
def test_the_scheduler_keeps_the_waiting_queue_it_is_given() -> None:
    queue = WaitingQueue(10.0, clock=lambda: 0.0)
    kv = KVManager(PagePool(4, 1), 2, "m", max_slots=2, host_pool=HostPagePool(2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, priority_aging_seconds=10.0).with_device_defaults("cpu"), kv, queue)
    assert scheduler.waiting is queue


def test_a_request_resumed_in_a_step_is_not_paused_again_in_that_step() -> None:
    t = [0.0]
    engine = FakeEngine(4, 2, host_pages=4, clock=lambda: t[0], max_num_seqs=1, priority_aging_seconds=10.0)
    x = make_request("x", [1, 2], max_tokens=3, arrival_time=0.0)
    engine.add(x)
    engine.step()
    engine.add(make_request("h", [3, 4], max_tokens=3, priority=100, arrival_time=0.0))
    plan = engine.step()
    assert plan.swapped == ["x"] and plan.swap_out == [(0, 0)]
    t[0] = 1.0  # x has waited a second: effective priority 6553.6, ahead of any fresh priority-100 request
    engine.add(make_request("y", [5, 6], max_tokens=1, priority=100, arrival_time=1.0))
    plan = engine.scheduler.plan()
    # Today: x resumes (pausing h), then y pauses x again in the same plan:
    # preempted [h, x], resumed [x], swap_out [(1, 1), (2, 0)], swap_in [(0, 2)]: host page 0 is
    # overwritten by device page 2 before device page 2 is filled from it.
    assert not set(plan.resumed) & set(plan.preempted)
    assert not {d for d, _ in plan.swap_out} & {d for _, d in plan.swap_in}


def test_an_aged_request_and_a_fresh_urgent_one_do_not_pause_each_other_every_step() -> None:
    t = [0.0]
    engine = FakeEngine(8, 2, host_pages=8, clock=lambda: t[0], max_num_seqs=1, priority_aging_seconds=10.0)
    x = make_request("x", [1, 2], max_tokens=4, arrival_time=0.0)
    h = make_request("h", [3, 4], max_tokens=4, priority=100, arrival_time=1.0)
    engine.add(x)
    engine.step()
    t[0] = 1.0
    engine.add(h)
    while engine.scheduler.has_unfinished():
        t[0] += 0.1
        engine.step()
    # Today: from the step h arrives on, x and h pause each other every step (x 3 times, h 3 times).
    assert x.num_preemptions <= 1 and h.num_preemptions <= 1


@pytest.mark.parametrize("host_pages", [0, 8])
def test_aging_lets_every_low_priority_request_finish_when_preemption_is_on(host_pages: int) -> None:
    t = [0.0]
    engine = FakeEngine(8, 2, host_pages=host_pages, clock=lambda: t[0], max_num_seqs=2,
                        max_num_batched_tokens=8, priority_aging_seconds=20.0)
    lows = [make_request(f"low{i}", [i, i + 1, i + 2], max_tokens=3, arrival_time=0.0) for i in range(3)]
    engine.add(*lows)
    for step in range(40):
        engine.add(make_request(f"high{step}", [100 + step, 101 + step], max_tokens=3, priority=1000,
                                arrival_time=t[0]))
        engine.step()
        t[0] += 1.0
    assert [low.status for low in lows] == [RequestStatus.FINISHED_LENGTH] * 3


def test_nobody_is_paused_when_pausing_cannot_free_token_budget() -> None:
    engine = FakeEngine(12, 2, host_pages=8, max_num_batched_tokens=4, prefill_chunk_size=4)
    low = make_request("low", list(range(1, 9)), max_tokens=10)
    engine.add(low)
    assert chunks(engine.step()) == [("low", 0, 4, False)]
    engine.add(make_request("high", list(range(10, 22)), max_tokens=1, priority=50))
    assert chunks(engine.step()) == [("high", 0, 4, False)]  # high outranks low's prefill: the budget is its
    engine.add(make_request("mid", [7, 8], max_tokens=1, priority=10))
    plan = engine.step()
    # high spends the whole budget; mid outranks low, but low has no chunk to give back: nobody is paused.
    assert chunks(plan) == [("high", 4, 4, False)]
    assert plan.preempted == [] and engine.running == ["low", "high"] and engine.waiting == ["mid"]


def test_an_urgent_request_with_a_cached_prefix_is_admitted_in_the_step_that_pauses_for_it() -> None:
    engine = FakeEngine(7, 2, prefill_chunk_size=4)
    engine.add(make_request("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1))
    engine.run_to_completion()
    assert engine.state == (3, 4, 0)  # tokens 1-8 are cached in 4 pages
    engine.add(make_request("l2", [50, 51, 52], max_tokens=5), make_request("l1", [60], max_tokens=5))
    engine.step()
    assert engine.state == (0, 4, 3)
    u = make_request("u", [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96], max_tokens=1, priority=10)
    engine.add(u)
    plan = engine.step()
    # u reuses 4 cached pages and needs 2 more: both l1 and l2 must go. Today only l1 is paused, and u
    # is not admitted until the next step.
    assert plan.preempted == ["l1", "l2"]
    assert chunks(plan) == [("u", 8, 4, True)]


# -- the pool storage's swap copies --------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_storage_swaps_pages_reading_every_source_before_writing(device: str) -> None:
    import torch

    from dflash2.engine.storage import PoolStorage, _runs

    assert _runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]
    storage = PoolStorage(7, 4, 6, torch.device(device))  # 8 device pages with the scratch page
    storage.device_pages.copy_(torch.arange(8 * 4, dtype=torch.uint8).reshape(8, 4))
    storage.host_pages.copy_((100 + torch.arange(6 * 4, dtype=torch.uint8)).reshape(6, 4))
    device_pages, host_pages = storage.device_pages, storage.host_pages
    before_device, before_host = device_pages.cpu().clone(), host_pages.clone()
    # Host page 1 is read by a swap-in and written by a swap-out; device page 2 read by a swap-out and
    # written by a swap-in; host pages 3, 4, 0 and device pages 6, 7 make runs and a gap.
    swap_out = [(2, 1), (5, 4), (3, 3), (0, 0)]
    swap_in = [(1, 2), (2, 6), (5, 7)]
    storage.swap(swap_out, swap_in)
    if device == "cuda":
        torch.cuda.synchronize()
    after_device, after_host = device_pages.cpu(), host_pages
    for device_page, host_page in swap_out:
        assert torch.equal(after_host[host_page], before_device[device_page])
    for host_page, device_page in swap_in:
        assert torch.equal(after_device[device_page], before_host[host_page])
    for page in (1, 4):  # untouched
        assert torch.equal(after_device[page], before_device[page])
    for page in (2, 5):
        assert torch.equal(after_host[page], before_host[page])
    # A swap-out's host copies run on a side stream on the GPU: a swap-in right after (no sync) that reads a
    # host page it wrote waits for them, and the step's writes into the freed device page do not.
    page = device_pages[4].cpu().clone()
    storage.swap([(4, 5)], [])
    device_pages[4] = 7
    storage.swap([], [(5, 3)])
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(device_pages[3].cpu(), page) and torch.equal(host_pages[5], page)
    assert int(device_pages[4].min()) == 7
    storage.swap([], [])  # nothing to copy: nothing happens
