"""The garbage collector in the server: every collection's pause as a histogram, and the thresholds it runs at.

A collection stops the whole process (the engine thread and the event loop alike: it holds the GIL). CPython
calls each of `gc.callbacks` with phase "start" and "stop" around it, on the thread that triggered it:

    allocation (or gc.collect()) ──► callback("start") ──► walk generation 0..g ──► callback("stop", g)
                                       perf_counter()                               + (now - start) into g's
                                                                                      bucket and sum

A pause is wall time on that thread: if a finalizer run by the collection lets another thread take the GIL,
that time is in it too. GcPauses takes no lock: a collection starts at an allocation (3.12+: at a bytecode
boundary) on any thread, possibly one that holds a lock observing would take again (prometheus_client's are
plain Locks: a deadlock). CPython runs one collection at a time, so the callback is the only writer of its
plain lists; /metrics reads them as a custom collector.
"""
from __future__ import annotations

import bisect
import gc
import itertools
from collections.abc import Iterator
from time import perf_counter

from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

GC_PAUSE_METRIC = "dflash2_gc_pause_seconds"  # the engine's process (the server's own, with --single-process)
SERVER_GC_PAUSE_METRIC = "dflash2_server_gc_pause_seconds"  # the HTTP server's process, when the engine has its own
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
NUM_GENERATIONS = 3


class GcPauses:
    """dflash2_gc_pause_seconds{model_name, generation}: one observation per collection, labelled with the
    oldest generation it walked (2: a full collection). A prometheus_client collector; install() hooks it into
    gc.callbacks, remove() unhooks it."""

    def __init__(self, model_name: str, metric: str = GC_PAUSE_METRIC) -> None:
        self.model_name = model_name
        self.metric = metric
        self._bounds = (*GC_PAUSE_BUCKETS, float("inf"))
        self._counts = [[0] * len(self._bounds) for _ in range(NUM_GENERATIONS)]  # per bucket, not cumulative
        self._sums = [0.0] * NUM_GENERATIONS
        self._started: float | None = None

    def install(self) -> None:
        if self.on_gc not in gc.callbacks:
            gc.callbacks.append(self.on_gc)

    def remove(self) -> None:
        if self.on_gc in gc.callbacks:
            gc.callbacks.remove(self.on_gc)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """The gc callback: never raises (an exception would surface in whatever code allocated)."""
        try:
            if phase == "start":
                self._started = perf_counter()
                return
            if self._started is None:
                return  # installed during this collection
            seconds = perf_counter() - self._started
            self._started = None
            generation = info["generation"]
            self._counts[generation][bisect.bisect_left(self._bounds, seconds)] += 1
            self._sums[generation] += seconds
        except Exception:  # noqa: BLE001
            pass

    # -- prometheus_client collector -----------------------------------------------------------------
    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = self._family()
        for generation in range(NUM_GENERATIONS):
            counts = list(self._counts[generation])
            buckets = [(floatToGoString(bound), count)
                       for bound, count in zip(self._bounds, itertools.accumulate(counts))]
            family.add_metric([self.model_name, str(generation)], buckets, self._sums[generation])
        yield family

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.metric, "Pause of one garbage collection, by the oldest generation "
                                     "it collected (2: full)", labels=("model_name", "generation"))


def settle_collector() -> tuple[int, tuple[int, int, int]]:
    """For a server process once the model is loaded (the engine's, and the HTTP one's when the engine has its
    own): freeze what is alive now, then set the server's thresholds; returns (objects frozen, thresholds).

    Freezing: collect once, then move every object alive now (the model's modules, torch, transformers, the
    graphs, the app: 200-300k objects) out of the collector's reach. A full collection otherwise walks all of
    them, a pause of the whole process whenever the objects allocated per token trigger one (222 ms measured on
    this project's 2-core CPU after loading the bundled model). A server process is long-lived, so nothing
    alive now is expected to become garbage (offline LLM() users keep the collector as it is)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), set_server_thresholds()


SERVER_THRESHOLDS = (700, 1, 500)  # gc.set_threshold in every process of the server (CPython's: 700, 10, 10)


def set_server_thresholds() -> tuple[int, int, int]:
    """The collector's thresholds in the server's processes (the engine's and the HTTP side's, or the one of
    --single-process): a generation-1 collection after every second young one (CPython: every eleventh), and a
    full one after 500 generation-1 collections (CPython: 10); returns them.

    Why: a waiting request holds gc-tracked objects that survive the young collections: ~180 in the HTTP side
    (its handler's coroutines, cells, bound methods, asyncio events and deques), a few in the engine (its
    Request).
    - A full collection walks all of them, and the process stands still meanwhile: on this project's 2-core
      CPU, with 1,600 requests waiting and 1,600 more arriving, each full collection took ~200 ms (with 3,200
      and 3,200: ~400 ms). So full collections are rare: ~1,000 young collections apart, as at (700, 10, 100),
      which had none under W3. What that defers is reclaiming reference cycles that reached the oldest
      generation, of which the server makes few (63 objects left after 6,400 requests).
    - A generation-1 collection walks what survived since the last one: at CPython's 10, ~7,000 objects, 4.5
      ms on average in the HTTP process on the H200's host under W3 (42 in ~55 s), up to 25 ms in the engine's.
      Collecting it five times as often walks the same objects in all, in pauses a fifth as long: in the HTTP
      process, 164 pauses of <= 2.5 ms against 44 of up to 10 ms, the same ~160 ms in all (W3, ninth session);
      on this CPU (benchmarks/gc_waiting.py, 1,600 waiting) 152 collections, 29.2 ms, against 37, 29.3 ms.
    - The young threshold stays at 700: a larger one makes young collections rarer but longer (most of a young
      generation is requests still waiting, so it survives; at 20,000 they took up to 25 ms).
    dflash2_gc_pause_seconds and dflash2_server_gc_pause_seconds show the pauses in a live server. (Python
    3.14's incremental collector ignores the third threshold.)"""
    gc.set_threshold(*SERVER_THRESHOLDS)
    return SERVER_THRESHOLDS
