"""WaitingQueue: requests not running, in the order they should be admitted.

Order: effective priority (higher first), then arrival (earlier first). A request's arrival number never
changes, so one that is paused and put back keeps its place in line. With aging, the effective priority
grows with time spent since arrival, by a full priority range (65536) every `aging_seconds`, so any
request waiting that long outranks any newer one: nothing starves under sustained urgent load.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from dflash2.request import Request


class WaitingQueue:
    PRIORITY_RANGE = 65536

    def __init__(self, aging_seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.aging_seconds = aging_seconds
        self.clock = clock
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, int] = {}

    def add(self, request: Request, arrival: int) -> None:
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = arrival

    def remove(self, request: Request) -> None:
        del self._requests[request.request_id]
        del self._arrival[request.request_id]

    def effective_priority(self, request: Request, now: float | None = None) -> float:
        if not self.aging_seconds:
            return float(request.priority)
        now = self.clock() if now is None else now
        waited = max(0.0, now - request.arrival_time)
        return request.priority + self.PRIORITY_RANGE * waited / self.aging_seconds

    def ordered(self) -> list[Request]:
        now = self.clock()
        return sorted(self._requests.values(),
                      key=lambda r: (-self.effective_priority(r, now), self._arrival[r.request_id]))

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())
