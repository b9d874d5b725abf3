"""The server side of W3: `dflash2 serve` as a subprocess, and what the benchmark reads back from it
(/metrics samples, step-time quantiles, garbage-collection pauses, per-class queue time and TTFT from the JSON
request log)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from typing import Any

import httpx
import numpy as np

from dflash2.bench.server_process import ServerProcess

STEP_METRIC = "dflash2_step_duration_seconds"
STEP_METRICS = (STEP_METRIC, "dflash2_step_launch_seconds", "dflash2_step_finish_seconds")  # histograms kept by `le`
GC_METRIC = "dflash2_gc_pause_seconds"  # kept by `generation` and `le` (the engine's process)
SERVER_GC_METRIC = "dflash2_server_gc_pause_seconds"  # the same for the HTTP server's process
COUNTERS = ("dflash2_num_preemptions_total", "dflash2_num_swap_outs_total", "dflash2_swapped_bytes_total",
            "dflash2_num_requests_rejected_total")
GAUGES = ("dflash2_num_requests_waiting", "dflash2_num_requests_running", "dflash2_num_requests_swapped",
          "dflash2_kv_cache_usage_perc")


def percentile_ms(values_s: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values_s) * 1000.0, q)), 1) if values_s else None


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def w3_server(flags: list[str], threads: int | None = None, log_dir: str | None = None) -> ServerProcess:
    """`dflash2 serve` with these flags on a free localhost port (OMP_NUM_THREADS=threads if given).
    W3_SERVER_PREFIX, if set, goes before the command: a profiler that runs the server as its child, e.g.
    `py-spy record -f raw -t -g -o spy.txt --`."""
    prefix = shlex.split(os.environ.get("W3_SERVER_PREFIX", ""))
    kind = _ProfiledServer if prefix else ServerProcess
    return kind(*flags, command=[*prefix, sys.executable, "-m", "dflash2.cli.main", "serve"],
                env={"OMP_NUM_THREADS": str(threads)} if threads else None,
                log_dir=log_dir or tempfile.mkdtemp(prefix="dflash2-w3-"))


class _ProfiledServer(ServerProcess):
    """The server under a profiler (W3_SERVER_PREFIX): stopped with SIGINT, on which py-spy writes its file and
    ends the server (on SIGTERM it exits without either)."""

    def stop(self, wait_s: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        super().stop(wait_s)


def scrape(url: str) -> dict[str, float]:
    """The W3-relevant samples of the server's /metrics (metric_samples())."""
    return metric_samples(httpx.get(url + "/metrics", timeout=30).text)


def metric_samples(text: str) -> dict[str, float]:
    """The W3-relevant samples of a /metrics text, summed over labels (step-time buckets keyed `name{le}`,
    garbage collection samples `name{generation,le}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.startswith(STEP_METRICS):
                name += "{%s}" % sample.labels.get("le", "")
            elif name.startswith((GC_METRIC, SERVER_GC_METRIC)):
                name += "{%s,%s}" % (sample.labels.get("generation", ""), sample.labels.get("le", ""))
            elif name not in COUNTERS and name not in GAUGES:
                continue
            values[name] = values.get(name, 0.0) + sample.value
    return values


def step_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Engine step wall time over a phase: count, mean, and p50/p99 as histogram bucket upper bounds; the same
    for its parts, launching (inputs + kernel launches) and finishing (waiting for results + committing)."""
    stats = _histogram_stats(STEP_METRIC, before, after)
    if stats["steps"]:
        for part in ("launch", "finish"):
            part_stats = _histogram_stats(f"dflash2_step_{part}_seconds", before, after)
            part_stats.pop("steps")
            if part_stats:
                stats[part] = part_stats
    return stats


def _histogram_stats(metric: str, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    count, total, buckets = _histogram_delta(before, after, metric + "_count{}", metric + "_sum{}", metric + "_bucket{")
    if count <= 0:
        return {"steps": 0}
    return {"steps": int(count), "mean_ms": round(1000 * total / count, 1),
            "p50_le_ms": _ms(_bound(buckets, 0.5 * count)), "p99_le_ms": _ms(_bound(buckets, 0.99 * count))}


def gc_stats(before: dict[str, float], after: dict[str, float], metric: str = GC_METRIC) -> dict[str, Any]:
    """Garbage collections over a phase, per generation (2: full): how many, their total milliseconds, and the
    bucket upper bound of the longest (None: over the last bucket, 1 s)."""
    stats = {}
    for generation in ("0", "1", "2"):
        count, total_s, buckets = _histogram_delta(before, after, f"{metric}_count{{{generation},}}",
                                                   f"{metric}_sum{{{generation},}}",
                                                   f"{metric}_bucket{{{generation},")
        if count <= 0:
            stats[generation] = {"collections": 0}
            continue
        longest = _bound(buckets, count)
        stats[generation] = {"collections": int(count), "total_ms": round(1000 * total_s, 2),
                             "max_le_ms": round(1000 * longest, 2) if longest != float("inf") else None}
    return stats


def _histogram_delta(before: dict[str, float], after: dict[str, float], count_key: str, sum_key: str,
                     bucket_prefix: str) -> tuple[float, float, list[tuple[float, float]]]:
    """A histogram's change between two scrapes (metric_samples() keys): count, sum, and the cumulative bucket
    counts [(upper bound, count)] in bound order (a bucket key is bucket_prefix + bound + "}")."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    buckets = sorted((float(key[len(bucket_prefix):-1]), delta(key)) for key in after if key.startswith(bucket_prefix))
    return delta(count_key), delta(sum_key), buckets


def _bound(buckets: list[tuple[float, float]], count: float) -> float | None:
    """The smallest bucket bound with at least `count` observations at or below it."""
    return next((le for le, n in buckets if n >= count), None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or seconds == float("inf") else round(1000 * seconds, 1)


def request_log(log_path: str) -> list[dict[str, Any]]:
    """The `request_finished` records of the server's JSON request log (its stdout)."""
    with open(log_path, errors="replace") as f:
        records = [json.loads(line) for line in f if line.startswith("{")]
    return [r for r in records if r.get("event") == "request_finished"]


def server_side(records: list[dict[str, Any]], since: float, until: float) -> dict[str, Any]:
    """Per priority class, from the server's request log (request_log()): queue time (arrival at the engine
    thread to first scheduled step) and TTFT as the engine thread saw it, and the HTTP side's share around it
    (http_in: the app received it -> the engine thread had it; http_out: first token -> first text written to
    the stream), for requests that finished in [since, until]."""
    fields = {"queue": "queue_time_ms", "ttft": "ttft_ms", "http_in": "http_in_ms", "http_out": "http_out_ms"}
    per_class: dict[int, dict[str, list[float]]] = {}
    for record in records:
        if not since <= record["time"] <= until:
            continue
        series = per_class.setdefault(record["priority"], {key: [] for key in fields})
        for key, field in fields.items():
            if record.get(field) is not None:
                series[key].append(record[field] / 1000.0)
    return {str(priority): {f"{key}_p{q}_ms": percentile_ms(values, q) for key, values in s.items() if values
                            for q in (50, 99)}
            for priority, s in sorted(per_class.items())}


def ttft_breakdown(records: list[dict[str, Any]], results: list[Any], slowest: int = 5) -> dict[str, Any] | None:
    """Where each client TTFT went, for the results whose response id is in the server's request log
    (request_log(); client and server on one host share its monotonic clock): `before_app`, the client sending
    -> the app received it (connecting, the server's event loop accepting and parsing); `in_app`, received -> its
    first text written to the stream; `after_write`, written -> the client parsed it. The three add up to the
    client's TTFT. Returns p50/p99 of each and the `slowest` requests' parts; None when nothing matches."""
    wanted = {r.request_id: r for r in results if r.ok and r.ttft_s is not None and r.request_id}
    # (ttft, before_app, in_app, after_write) in seconds
    parts: list[tuple[float, float, float, float]] = []
    for record in records:
        result = wanted.get(record["request_id"])
        received, written = record.get("received_monotonic"), record.get("first_sent_monotonic")
        if result is None or received is None or written is None:
            continue
        parts.append((result.ttft_s, received - result.started_at, written - received,
                      result.started_at + result.ttft_s - written))
    if not parts:
        return None
    names = ("before_app", "in_app", "after_write")
    summary: dict[str, Any] = {"requests": len(parts)}
    for i, name in enumerate(names, start=1):
        summary[f"{name}_p50_ms"] = percentile_ms([p[i] for p in parts], 50)
        summary[f"{name}_p99_ms"] = percentile_ms([p[i] for p in parts], 99)
    summary["slowest"] = [{"ttft_ms": round(p[0] * 1000, 1),
                           **{name: round(p[i] * 1000, 1) for i, name in enumerate(names, start=1)}}
                          for p in sorted(parts, reverse=True)[:slowest]]
    return summary

