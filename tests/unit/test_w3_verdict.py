"""W3's verdict (benchmarks/priority.py): the ratio target, judged only on a stable idle phase."""
from __future__ import annotations

from benchmarks.priority import verdict


def test_a_ratio_within_two_on_a_steady_idle_phase_meets_the_target():
    target = verdict(urgent_p99=10.6, idle_p50=4.4, idle_p99=5.4, failed=0, completed=1600, requested=1600)
    assert target["urgent_ttft_p99_ratio"] == 1.96 and target["idle_stable"] and target["met"]
    assert verdict(14.3, 4.4, 5.4, 0, 1600, 1600)["met"] is False  # ratio 2.65


def test_an_idle_p99_set_by_a_few_disturbed_requests_is_not_judged():
    """Seventh session, call 3: two idle requests met a once-a-second stall (p99 15.1 against a median of
    4.3), and the overload p99 of 14.3 printed a ratio of 0.95."""
    target = verdict(14.3, 4.3, 15.1, 0, 1600, 1600)
    assert target["urgent_ttft_p99_ratio"] == 0.95 and target["idle_p99_over_p50"] == 3.51
    assert not target["idle_stable"] and not target["met"]


def test_errors_or_unfinished_requests_miss_the_target():
    assert not verdict(8.0, 4.4, 5.4, 1, 1600, 1600)["met"]
    assert not verdict(8.0, 4.4, 5.4, 0, 1599, 1600)["met"]
    assert verdict(None, 4.4, 5.4, 0, 0, 1600)["urgent_ttft_p99_ratio"] is None
