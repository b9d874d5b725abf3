"""dflash2_gc_pause_seconds: one observation per garbage collection, by generation, while installed; what W3
reads back from it; the server's collector thresholds."""
from __future__ import annotations

import gc

import pytest

from benchmarks.w3_server import gc_stats, metric_samples
from dflash2.server import gc_pauses
from dflash2.server.gc_pauses import GC_PAUSE_BUCKETS, set_server_thresholds
from dflash2.server.metrics import ServerMetrics


@pytest.fixture
def collector_off():
    """No automatic collection during the test, so that only its own gc.collect() calls are counted."""
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def counts(metrics: ServerMetrics) -> list[float]:
    return [metrics.registry.get_sample_value("dflash2_gc_pause_seconds_count",
                                              {"model_name": "m", "generation": str(g)}) for g in range(3)]


def test_each_collection_is_one_sample_of_its_generation(collector_off):
    metrics = ServerMetrics("m")
    metrics.gc_pauses.install()
    try:
        assert counts(metrics) == [0, 0, 0]
        gc.collect()
        assert counts(metrics) == [0, 0, 1]
        gc.collect(0)
        gc.collect(1)
        gc.collect(1)
        assert counts(metrics) == [1, 2, 1]
    finally:
        metrics.gc_pauses.remove()
    gc.collect()
    assert counts(metrics) == [1, 2, 1]  # removed: no longer recorded


def test_the_histogram_is_cumulative_and_its_sum_is_the_pauses(collector_off):
    metrics = ServerMetrics("m")
    metrics.gc_pauses.install()
    try:
        gc.collect()
        gc.collect()
    finally:
        metrics.gc_pauses.remove()
    labels = {"model_name": "m", "generation": "2"}
    buckets = [metrics.registry.get_sample_value("dflash2_gc_pause_seconds_bucket", {**labels, "le": le})
               for le in [*(str(b) for b in GC_PAUSE_BUCKETS), "+Inf"]]
    assert buckets == sorted(buckets) and buckets[-1] == 2
    assert metrics.registry.get_sample_value("dflash2_gc_pause_seconds_sum", labels) > 0
    assert 'dflash2_gc_pause_seconds_count{generation="0",model_name="m"} 0.0' in metrics.render().decode()


def test_installing_twice_records_once_and_a_bad_call_does_not_raise(collector_off):
    metrics = ServerMetrics("m")
    metrics.gc_pauses.install()
    metrics.gc_pauses.install()
    try:
        gc.collect()
        assert counts(metrics) == [0, 0, 1]
        metrics.gc_pauses.on_gc("stop", {"generation": 1})  # no "start" before it: ignored
        metrics.gc_pauses.on_gc("start", {})
        metrics.gc_pauses.on_gc("stop", {})  # no generation: swallowed
        assert counts(metrics) == [0, 0, 1]
    finally:
        metrics.gc_pauses.remove()
    assert metrics.gc_pauses.on_gc not in gc.callbacks


def test_w3_reports_collections_total_and_longest_bucket_per_generation(monkeypatch):
    metrics = ServerMetrics("m")
    before = metric_samples(metrics.render().decode())
    clock = iter([10.0, 10.0002, 20.0, 20.003, 30.0, 30.04, 40.0, 42.0])
    monkeypatch.setattr(gc_pauses, "perf_counter", lambda: next(clock))
    for generation in (0, 2, 2, 1):  # 0.2 ms, 3 ms, 40 ms, 2 s
        metrics.gc_pauses.on_gc("start", {"generation": generation})
        metrics.gc_pauses.on_gc("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    stats = gc_stats(before, metric_samples(metrics.render().decode()))
    assert stats == {"0": {"collections": 1, "total_ms": 0.2, "max_le_ms": 0.25},
                     "1": {"collections": 1, "total_ms": 2000.0, "max_le_ms": None},  # over the last bucket
                     "2": {"collections": 2, "total_ms": 43.0, "max_le_ms": 50.0}}


def test_the_server_collects_the_middle_generation_often_and_the_full_one_rarely():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert set_server_thresholds() == (700, 1, 500)
        assert gc.get_threshold() == (700, 1, 500)
    finally:
        gc.set_threshold(*saved)
