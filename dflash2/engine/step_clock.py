"""StepClock: when the step in flight ends on the device, so that the next one is planned just in time.

With overlap the engine plans and launches step N+1 while step N runs. Planned right after N's launch, N+1 is
fixed before anything that arrives during N: an urgent request arriving then waits for all of N+1 and runs in
N+2. Late planning moves the plan of N+1 to just before N ends on the device: the server's loop asks
`Engine.plan_delay()` before each step() and takes in arrivals until then, so they make it into N+1. The
device does not idle for it as long as the prediction holds: N+1 is launched a lead ahead of N's end.

    device start of N   when N-1's results were collected (the host waits for them), or N's launch if later
    device time of N    predicted per size class: an exponential average of the device times of collected
                        steps (two timing events around each launch), by half-octave of the step's tokens,
                        steps with swaps apart
    lead                the host time a plan and a launch take (their average), times LEAD_FACTOR, plus
                        LEAD_MARGIN_S

A size class not seen yet predicts nothing (no delay). Predictions only delay the plan, never the device's work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash2.engine.plan import StepPlan

EMA_WEIGHT = 0.2  # of the newest observation
LEAD_FACTOR = 1.5
LEAD_MARGIN_S = 0.25e-3
MAX_DELAY_S = 0.05  # a cap against a wild prediction


@dataclass
class StepTiming:
    """One launched step's clock: its size class, timing events, and when its launch returned (perf_counter)."""

    key: tuple[bool, int]
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    launched_at: float = 0.0


def size_class(plan: StepPlan) -> tuple[bool, int]:
    return bool(plan.swap_in or plan.swap_out), round(2 * math.log2(max(1, plan.num_tokens)))


class StepClock:
    def __init__(self) -> None:
        self.device_seconds: dict[tuple[bool, int], float] = {}  # size class -> average device time
        self.host_seconds: float | None = None  # average plan + launch time
        self.last_collected = 0.0  # perf_counter when the latest step's results were in
        self.launches_behind = 0  # launches with a step in flight
        self.launches_late = 0  # of those, the ones that found it already done: the device idled

    # -- around a step ------------------------------------------------------------------------------
    def launching(self, plan: StepPlan, cuda: bool, in_flight_done: bool | None = None) -> StepTiming:
        """Before the launch: its start event (a step queued behind another starts its clock when that ends).
        in_flight_done: whether the step in flight had ended already (None: nothing in flight)."""
        if in_flight_done is not None:
            self.launches_behind += 1
            self.launches_late += in_flight_done
        timing = StepTiming(size_class(plan), None, None)
        if cuda:
            timing.start = torch.cuda.Event(enable_timing=True)
            timing.start.record()
        return timing

    def launched(self, timing: StepTiming, host_seconds: float, now: float) -> None:
        """After the launch, with the plan + launch host time it took."""
        if timing.start is not None:
            timing.end = torch.cuda.Event(enable_timing=True)
            timing.end.record()
        timing.launched_at = now
        self._average_host(host_seconds)

    def collected(self, timing: StepTiming, now: float) -> None:
        """The step's results are in: its device time joins its class's average."""
        self.last_collected = now
        if timing.end is not None:
            timing.end.synchronize()  # recorded right after the step's own end event: reached by now
            self.observe(timing.key, timing.start.elapsed_time(timing.end) / 1e3)

    # -- the model ----------------------------------------------------------------------------------
    def observe(self, key: tuple[bool, int], seconds: float) -> None:
        old = self.device_seconds.get(key)
        self.device_seconds[key] = seconds if old is None else old + EMA_WEIGHT * (seconds - old)

    def _average_host(self, seconds: float) -> None:
        old = self.host_seconds
        self.host_seconds = seconds if old is None else old + EMA_WEIGHT * (seconds - old)

    def lead(self) -> float:
        return (self.host_seconds or 0.0) * LEAD_FACTOR + LEAD_MARGIN_S

    def delay(self, timing: StepTiming, now: float) -> float:
        """Seconds from `now` until the next step should be planned: the step in flight's predicted end, less
        the lead; 0 when its size class has no prediction yet or that time has passed. The step in flight started
        on the device when the one before it was collected, or at its own launch if that came later."""
        predicted = self.device_seconds.get(timing.key)
        if predicted is None:
            return 0.0
        device_start = max(self.last_collected, timing.launched_at)
        return min(MAX_DELAY_S, max(0.0, device_start + predicted - self.lead() - now))

    def summary(self) -> str:
        return (f"late planning: {self.launches_late} of {self.launches_behind} launches behind a step in flight "
                f"came after it had ended (the device idled)")
