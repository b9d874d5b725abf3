"""The server side of W3: `dflash2 serve` as a subprocess, and what the benchmark reads back from it
(/metrics samples, step-time quantiles, per-class queue time and TTFT from the JSON request log)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np

STEP_METRIC = "dflash2_step_duration_seconds"
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


class Server:
    """`dflash2 serve` on a free localhost port; its logs go to a temporary directory."""

    def __init__(self, flags: list[str], threads: int | None = None, log_dir: str | None = None) -> None:
        self.env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "dflash2.cli.main", "serve", "--port", str(self.port), *flags]
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="dflash2-w3-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> Server:
        with open(os.path.join(self.log_dir, "stdout.log"), "wb") as out, \
                open(os.path.join(self.log_dir, "stderr.log"), "wb") as err:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=err, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s:\n{self.stderr_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stderr_tail(self, num_lines: int = 40) -> str:
        with open(os.path.join(self.log_dir, "stderr.log"), errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])


def scrape(url: str) -> dict[str, float]:
    """The W3-relevant samples of /metrics, summed over labels (step-time buckets keyed `name{le}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.startswith(STEP_METRIC):
                name += "{%s}" % sample.labels.get("le", "")
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
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    count = delta(metric + "_count{}")
    if count <= 0:
        return {"steps": 0}
    buckets = sorted((float(key[len(metric) + 8:-1]), delta(key)) for key in after
                     if key.startswith(metric + "_bucket{"))
    quantile = {q: next((le for le, n in buckets if n >= q * count), None) for q in (0.5, 0.99)}
    return {"steps": int(count), "mean_ms": round(1000 * delta(metric + "_sum{}") / count, 1),
            "p50_le_ms": _ms(quantile[0.5]), "p99_le_ms": _ms(quantile[0.99])}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or seconds == float("inf") else round(1000 * seconds, 1)


def server_side(log_path: str, since: float, until: float) -> dict[str, Any]:
    """Per priority class, from the server's JSON request log: queue time (arrival at the engine thread to
    first scheduled step) and TTFT as the engine thread saw it, for requests that finished in [since, until]."""
    per_class: dict[int, dict[str, list[float]]] = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("event") != "request_finished" or not since <= record["time"] <= until:
                continue
            series = per_class.setdefault(record["priority"], {"queue": [], "ttft": []})
            for key, field in (("queue", "queue_time_ms"), ("ttft", "ttft_ms")):
                if record.get(field) is not None:
                    series[key].append(record[field] / 1000.0)
    return {str(priority): {"queue_p50_ms": percentile_ms(s["queue"], 50), "queue_p99_ms": percentile_ms(s["queue"], 99),
                            "ttft_p50_ms": percentile_ms(s["ttft"], 50), "ttft_p99_ms": percentile_ms(s["ttft"], 99)}
            for priority, s in sorted(per_class.items())}
