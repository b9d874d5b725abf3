"""WaitingQueue: requests not running, in the order they should be admitted.

Order: effective priority (higher first), then arrival (earlier first). A request's arrival number never
changes, so one that is paused and put back keeps its place in line. With aging, the effective priority
grows with time spent since arrival, by a full priority range (65536) every `aging_seconds`, so any
request waiting that long outranks any newer one: nothing starves under sustained urgent load.

The line is kept sorted as requests join and leave (a step under overload reads it with hundreds waiting):
aging adds the same amount to everyone's priority per second waited, so the order by
    priority + 65536 (now - arrival_time) / aging_seconds
is the order by priority - 65536 arrival_time / aging_seconds, which does not change with `now` (while no
request's arrival_time lies ahead of the clock; a test clock that does this gets a full sort).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator

from dflash2.request import Request


class WaitingQueue:
    PRIORITY_RANGE = 65536

    def __init__(self, aging_seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.aging_seconds = aging_seconds
        self.clock = clock
        self._requests: dict[str, Request] = {}
        self._line: list[tuple[float, int, str]] = []  # (static key, arrival number, id), sorted
        self._keys: dict[str, tuple[float, int, str]] = {}  # each waiting request's entry in the line
        self._latest_arrival_time = float("-inf")

    def add(self, request: Request, arrival: int) -> None:
        request_id = request.request_id
        self._requests[request_id] = request
        entry = (-self._static_priority(request), arrival, request_id)
        self._keys[request_id] = entry
        bisect.insort(self._line, entry)
        self._latest_arrival_time = max(self._latest_arrival_time, request.arrival_time)

    def remove(self, request: Request) -> None:
        request_id = request.request_id
        del self._requests[request_id]
        entry = self._keys.pop(request_id)
        del self._line[bisect.bisect_left(self._line, entry)]

    def num_ahead(self, request: Request) -> int | None:
        """How many waiting requests stand before this one in the kept line (None: it is not waiting)."""
        entry = self._keys.get(request.request_id)
        return None if entry is None else bisect.bisect_left(self._line, entry)

    def arrival(self, request: Request) -> int:
        """A waiting request's arrival number (its place in line among equal priorities)."""
        return self._keys[request.request_id][1]

    def _static_priority(self, request: Request) -> float:
        """The effective priority less what every waiting request gains alike per second (see above)."""
        if not self.aging_seconds:
            return float(request.priority)
        return request.priority - self.PRIORITY_RANGE * request.arrival_time / self.aging_seconds

    def effective_priority(self, request: Request, now: float | None = None) -> float:
        if not self.aging_seconds:
            return float(request.priority)
        now = self.clock() if now is None else now
        waited = max(0.0, now - request.arrival_time)
        return request.priority + self.PRIORITY_RANGE * waited / self.aging_seconds

    def ordered(self) -> Iterable[Request]:
        """The line as it is now, most urgent first: iterable any number of times, lazily (the scheduler reads
        the first few of hundreds), leaving out requests that have left since."""
        now = self._clamped_now()
        if now is not None:  # someone's waited time is clamped at 0: sort in full
            return sorted(self._requests.values(), key=lambda r: (-self.effective_priority(r, now), self.arrival(r)))
        return _Line(self._requests, self._line.copy())

    def head(self) -> Request | None:
        """The most urgent waiting request."""
        if self._clamped_now() is not None:
            return next(iter(self.ordered()), None)
        return self._requests[self._line[0][2]] if self._line else None

    def _clamped_now(self) -> float | None:
        """The clock, if aging is on and a request's arrival lies ahead of it (the kept order does not hold)."""
        if not self.aging_seconds:
            return None
        now = self.clock()
        return now if now < self._latest_arrival_time else None

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())


class _Line:
    """A snapshot of the line's order; each iteration yields the requests of it still waiting."""

    __slots__ = ("requests", "entries")

    def __init__(self, requests: dict[str, Request], entries: list[tuple[float, int, str]]) -> None:
        self.requests = requests
        self.entries = entries

    def __iter__(self) -> Iterator[Request]:
        requests = self.requests
        for _, _, request_id in self.entries:
            request = requests.get(request_id)
            if request is not None:
                yield request
