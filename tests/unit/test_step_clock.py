"""StepClock (late planning): the predicted device time by size class, the lead, and when the next step should
be planned. Device times are fed in directly (on CUDA they come from timing events around each launch)."""
from __future__ import annotations

import pytest

from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.engine.step_clock import LEAD_FACTOR, LEAD_MARGIN_S, MAX_DELAY_S, StepClock, size_class


def plan(num_tokens: int, swap: bool = False) -> StepPlan:
    chunk = ScheduledChunk("r", 0, (5,) * num_tokens, 0, 0, (), True)
    return StepPlan(chunks=[chunk], swap_out=[(1, 2)] if swap else [])


def launched(clock: StepClock, step: StepPlan, host_s: float, at: float):
    timing = clock.launching(step, cuda=False)
    clock.launched(timing, host_s, at)
    return timing


def test_size_classes_are_half_octaves_of_tokens_with_swap_steps_apart():
    assert size_class(plan(1)) == (False, 0)
    assert size_class(plan(2048)) == (False, 22)
    assert size_class(plan(290)) == size_class(plan(300)) != size_class(plan(330))  # 2 log2: 16.4, 16.5, 16.7
    assert size_class(plan(300, swap=True)) == (True, size_class(plan(300))[1])


def test_no_delay_for_a_size_class_never_collected():
    clock = StepClock()
    clock.observe(size_class(plan(16)), 2e-3)
    assert clock.delay(launched(clock, plan(512), 1e-4, at=5.0), now=5.0) == 0.0


def test_the_plan_waits_for_the_predicted_end_less_the_lead():
    clock = StepClock()
    clock.observe(size_class(plan(512)), 4e-3)
    clock.last_collected = 4.0  # the step before was collected long before this one's launch
    timing = launched(clock, plan(512), 2e-4, at=5.0)
    lead = 2e-4 * LEAD_FACTOR + LEAD_MARGIN_S
    assert clock.lead() == pytest.approx(lead)
    assert clock.delay(timing, now=5.0) == pytest.approx(4e-3 - lead)
    assert clock.delay(timing, now=5.001) == pytest.approx(3e-3 - lead)
    assert clock.delay(timing, now=5.01) == 0.0  # past it: plan now


def test_a_step_queued_behind_another_starts_when_that_one_is_collected():
    clock = StepClock()
    clock.observe(size_class(plan(64)), 2e-3)
    timing = launched(clock, plan(64), 0.0, at=5.0)
    clock.last_collected = 5.003  # the step before ended after this launch
    assert clock.delay(timing, now=5.003) == pytest.approx(2e-3 - LEAD_MARGIN_S)


def test_device_times_are_averaged_per_class_and_delays_capped():
    clock = StepClock()
    key = size_class(plan(100))
    clock.observe(key, 4e-3)
    clock.observe(key, 9e-3)
    assert clock.device_seconds[key] == pytest.approx(5e-3)  # 4 + 0.2 * (9 - 4)
    clock.observe(key, 10.0)
    assert clock.delay(launched(clock, plan(100), 0.0, at=1.0), now=1.0) == MAX_DELAY_S


def test_launches_that_find_the_step_in_flight_done_are_counted():
    clock = StepClock()
    clock.launching(plan(8), cuda=False)  # nothing in flight
    clock.launching(plan(8), cuda=False, in_flight_done=False)
    clock.launching(plan(8), cuda=False, in_flight_done=True)
    assert (clock.launches_behind, clock.launches_late) == (2, 1)
    assert clock.summary() == ("late planning: 1 of 2 launches behind a step in flight came after it had ended "
                               "(the device idled)")
