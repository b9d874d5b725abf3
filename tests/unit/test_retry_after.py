"""Retry-After of a full queue: the waiting line's drain time at the engine's recent finish rate (issue 40)."""
from __future__ import annotations

from dflash2.server.engine_loop import RATE_WINDOW_S, EngineLoop, FinishWindow


def loop_busy_since(start: float) -> EngineLoop:
    loop = EngineLoop(lambda: None, lambda engine: None, max_queue_len=100)  # (factories never called)
    loop._busy_since = start
    return loop


def test_a_batch_finishing_in_one_step_does_not_read_as_an_infinite_rate():
    loop = loop_busy_since(0.0)
    for _ in range(64):  # one step finishes a whole batch: 64 finishes at one instant
        loop._finishes.add(4.0)
    # 64 finishes in 4 busy seconds: 16 a second, so 100 waiting take 6.25 s (it said 1 s before)
    assert loop._drain_estimate_s(100, now=4.0) == 7
    assert loop._drain_estimate_s(1000, now=4.0) == 60  # clamped


def test_the_rate_counts_only_the_recent_busy_window():
    loop = loop_busy_since(0.0)
    for t in range(100):  # fast early on: 10 a second over 10 s
        loop._finishes.add(t / 10)
    loop._finishes.add(100.0)  # then one in the last RATE_WINDOW_S seconds
    assert loop._drain_estimate_s(10, now=100.0) == 60  # 1 per 30 s now: long
    fresh = loop_busy_since(99.0)  # a new busy period: the earlier finishes do not count
    fresh._finishes.add(99.5)
    fresh._finishes.add(100.0)
    assert fresh._drain_estimate_s(4, now=100.0) == 2


def test_nothing_finished_yet_waits_at_least_as_long_as_the_engine_has_been_busy():
    loop = loop_busy_since(0.0)
    assert loop._drain_estimate_s(50, now=0.2) == 1
    assert loop._drain_estimate_s(50, now=12.5) == 13
    assert loop._drain_estimate_s(50, now=RATE_WINDOW_S * 10) == 30


def test_early_in_a_burst_the_rate_of_the_requests_in_service_counts():
    """At 3 s into a burst only 10 short requests have finished (one per 0.3 s); 512 running requests with 2.5 s
    in service each finish about 205 a second (Little's law), so 392 waiting drain in about 2 s, not 118."""
    from types import SimpleNamespace

    loop = loop_busy_since(0.0)
    for i in range(10):
        loop._finishes.add(2.5 + i * 0.05)  # no service times: the finish count alone
    loop.engine = SimpleNamespace(num_running=512)
    assert loop._drain_estimate_s(392, now=3.0) == 60  # 117.6 s, clamped
    assert loop._drain_seconds(392, now=3.0) == 392 * 3.0 / 10
    loop._finishes = FinishWindow()  # the same 10 finishes, now with their 2.5 s in service
    for i in range(10):
        loop._finishes.add(2.5 + i * 0.05, 2.5)
    assert loop._drain_seconds(392, now=3.0) == 392 * 2.5 / 512
    assert loop._drain_estimate_s(392, now=3.0) == 2
    loop.engine = SimpleNamespace(num_running=1)  # one in service: the finish count is the faster rate
    assert loop._drain_seconds(392, now=3.0) == 392 * 3.0 / 10


def test_the_window_forgets_old_finishes_and_their_time_in_service():
    window = FinishWindow()
    window.add(0.0, 10.0)
    window.add(1.0)  # a finish whose start is unknown: counted, not in the mean
    window.add(RATE_WINDOW_S + 0.5, 2.0)  # 0.0 is out of the window now
    assert len(window) == 2 and window.mean_service_s() == 2.0
    window.drop_before(RATE_WINDOW_S)
    assert len(window) == 1 and window.mean_service_s() == 2.0
    window.drop_before(RATE_WINDOW_S + 1)
    assert len(window) == 0 and window.mean_service_s() is None
