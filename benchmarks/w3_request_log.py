"""Summarize one class of a W3 run from the server's own request log (one JSON line per finished request):
where its time to first token went, in the overload phase (JSON out).

    W3_RUNS=poisson bash benchmarks/gpu_w3.sh      # the log: $OUT/w3_server_poisson/stdout.log
    python3 benchmarks/w3_request_log.py $OUT/w3_server_poisson/stdout.log [--priority 1000]

Phases are told apart by gaps of more than --gap-s between arrivals (priority.py's warm-up, idle and overload
phases are separated by pauses); the overload phase is the one with the most requests. For the class: count,
and p50 / p90 / p99 / max of
    ttft_ms       arrival in the engine -> first token out of it
    queue_ms      arrival -> first planned into a step (the step in flight, and with overlap the one after)
    step_ms       planned -> first token (its own step, behind the step in flight)
    http_in_ms, http_out_ms   the HTTP side around the engine
and how many first tokens took more than 7 and 8 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.w3_server import request_log  # noqa: E402


def read_log(path: str) -> list[dict[str, Any]]:
    """The log's finished requests (w3_server.request_log) in arrival order."""
    return sorted(request_log(path), key=lambda r: r["received_monotonic"])


def phases(rows: list[dict[str, Any]], gap_s: float) -> list[list[dict[str, Any]]]:
    """Requests split where no request arrived for more than gap_s."""
    out: list[list[dict[str, Any]]] = []
    for row in rows:
        if not out or row["received_monotonic"] - out[-1][-1]["received_monotonic"] > gap_s:
            out.append([])
        out[-1].append(row)
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of values (ms, two decimals)."""
    a = np.asarray(values, dtype=float)
    return {"p50": round(float(np.percentile(a, 50)), 2), "p90": round(float(np.percentile(a, 90)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "max": round(float(a.max()), 2)}


def summarize(rows: list[dict[str, Any]], priority: int, gap_s: float = 0.5) -> dict[str, Any]:
    parts = phases(rows, gap_s)
    overload = max(parts, key=len) if parts else []
    chosen = [r for r in overload if r["priority"] == priority]
    result: dict[str, Any] = {"phases": [len(p) for p in parts], "priority": priority, "requests": len(chosen)}
    if not chosen:
        return result
    ttft = [r["ttft_ms"] for r in chosen]
    result["ttft_ms"] = percentiles(ttft)
    result["queue_ms"] = percentiles([r["queue_time_ms"] for r in chosen])
    result["step_ms"] = percentiles([r["ttft_ms"] - r["queue_time_ms"] for r in chosen])
    for key in ("http_in_ms", "http_out_ms"):
        result[key] = percentiles([r[key] for r in chosen])
    result["ttft_over_7_ms"] = sum(t > 7 for t in ttft)
    result["ttft_over_8_ms"] = sum(t > 8 for t in ttft)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="the server's stdout log (request_finished JSON lines)")
    parser.add_argument("--priority", type=int, default=1000, help="the class to summarize")
    parser.add_argument("--gap-s", type=float, default=0.5, help="a pause this long between arrivals ends a phase")
    args = parser.parse_args()
    print(json.dumps(summarize(read_log(args.log), args.priority, args.gap_s), indent=1))


if __name__ == "__main__":
    main()
