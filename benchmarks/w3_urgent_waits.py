"""What each urgent request of a W3 run waited behind: the server's request log joined with the step trace
(both keep time.monotonic(), the host-wide clock), for the overload phase or the idle one (JSON out).

    DFLASH2_STEP_TRACE=$OUT/steps.jsonl W3_RUNS=poisson bash benchmarks/gpu_w3.sh
    python3 benchmarks/w3_urgent_waits.py $OUT/w3_server_poisson/stdout.log $OUT/steps.jsonl [--priority 1000]
        [--phase overload|idle]

For each request of the class, from its arrival in the engine (`submitted`) to its first token:
    to_plan_ms     submitted -> its own step planned (the host finishing what it was doing when it arrived)
    launch_ms      its step's plan and launch (host)
    to_done_ms     launched -> the step's results in on the host (the device: the steps ahead of it, then its own)
    deliver_ms     results in -> the first token out of the engine (commit, and the engine loop's hand-off)
    own_device_ms  its own step's time on the device (CUDA traces: the step trace's device_ms)
and what was in flight when it arrived: the steps planned before it arrived whose results were not in yet.
Prints p50 / p90 / p99 / max of each part, and the slowest requests with their steps; and `host_gaps`: for every step
of the phase, how long the engine's host was idle before planning it (since the previous step's launch or the
latest results in, whichever came later), where stalls of the engine loop show (a /metrics render, a
collection).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.w3_request_log import percentiles, phases, read_log  # noqa: E402

PARTS = ("ttft_ms", "to_plan_ms", "launch_ms", "to_done_ms", "deliver_ms", "steps_ahead")
STEP_FIELDS = ("decodes", "prefill_tokens", "swap_out_pages", "swap_in_pages", "device_ms", "plan_ms", "launch_ms",
               "finish_ms")


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def _step_view(step: dict[str, Any], origin: float) -> dict[str, Any]:
    return {"planned_ms": _ms(step["mono_s"] - origin), **{k: step.get(k) for k in STEP_FIELDS}}


def urgent_waits(requests: list[dict[str, Any]], steps: list[dict[str, Any]], priority: int,
                 slowest: int = 8) -> dict[str, Any]:
    """The parts above for every request of `priority` found in the trace (requests: one phase of the log)."""
    steps = sorted((s for s in steps if s.get("done_mono_s") is not None), key=lambda s: s["mono_s"])
    planned = [s["mono_s"] for s in steps]
    sampled_by = {rid: s for s in steps for rid in s.get("sampling_prefills", [])}
    rows = []
    for request in requests:
        own = sampled_by.get(request["request_id"])
        if request.get("priority") != priority or own is None or request.get("ttft_ms") is None:
            continue
        submitted = request["received_monotonic"] + (request.get("http_in_ms") or 0.0) / 1e3
        launched = own["mono_s"] + (own["plan_ms"] + own["launch_ms"]) / 1e3
        # steps planned before it arrived (the latest few suffice) whose results were not in when it did
        first = bisect.bisect_right(planned, submitted)
        ahead = [s for s in steps[max(0, first - 4):first] if s["done_mono_s"] > submitted]
        rows.append({
            "request_id": request["request_id"], "ttft_ms": request["ttft_ms"],
            "to_plan_ms": _ms(own["mono_s"] - submitted), "launch_ms": round(own["plan_ms"] + own["launch_ms"], 3),
            "to_done_ms": _ms(own["done_mono_s"] - own["finish_ms"] / 1e3 - launched),
            "deliver_ms": round(request["ttft_ms"] - _ms(own["done_mono_s"] - own["finish_ms"] / 1e3 - submitted), 3),
            "steps_ahead": len(ahead), "own_device_ms": own.get("device_ms"),
            "_steps": [_step_view(s, submitted) for s in ahead] + [{"own": True, **_step_view(own, submitted)}]})
    if not rows:
        return {"requests": 0}
    report: dict[str, Any] = {"requests": len(rows)}
    for part in PARTS:
        report[part] = percentiles([r[part] for r in rows])
    if all(r["own_device_ms"] is not None for r in rows):
        report["own_device_ms"] = percentiles([r["own_device_ms"] for r in rows])
    ahead_kinds: dict[str, int] = {}
    for row in rows:
        for step in row["_steps"][:-1]:
            kind = "decode_only" if not step["prefill_tokens"] else "with_prefill"
            if step["swap_out_pages"] or step["swap_in_pages"]:
                kind += "+swaps"
            ahead_kinds[kind] = ahead_kinds.get(kind, 0) + 1
    report["steps_ahead_by_kind"] = ahead_kinds
    report["slowest"] = [{**{k: v for k, v in r.items() if k != "_steps"}, "steps": r["_steps"]}
                         for r in sorted(rows, key=lambda r: -r["ttft_ms"])[:slowest]]
    return report


def host_gaps(steps: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """The host's idle time before each plan of the steps planned in [start, end] (monotonic seconds)."""
    steps = sorted((s for s in steps if start <= s["mono_s"] <= end and s.get("done_mono_s") is not None),
                   key=lambda s: s["mono_s"])
    dones = sorted(s["done_mono_s"] for s in steps)
    gaps = []
    for before, step in zip(steps, steps[1:]):
        launched = before["mono_s"] + (before["plan_ms"] + before["launch_ms"]) / 1e3
        latest = bisect.bisect_left(dones, step["mono_s"]) - 1
        gaps.append(_ms(step["mono_s"] - max(launched, dones[latest] if latest >= 0 else launched)))
    if not gaps:
        return {"steps": 0}
    stats = percentiles(gaps)
    return {"steps": len(gaps), "p50_ms": stats["p50"], "p99_ms": stats["p99"], "max_ms": stats["max"],
            "over_2_ms": sum(g > 2 for g in gaps), "over_3.5_ms": sum(g > 3.5 for g in gaps),
            "seconds": round(end - start, 3)}


def _runs_of(rows: list[dict[str, Any]], priority: int) -> list[list[dict[str, Any]]]:
    """Runs of consecutive arrivals all of this priority."""
    runs: list[list[dict[str, Any]]] = [[]]
    for row in sorted(rows, key=lambda r: r["received_monotonic"]):
        if row.get("priority") == priority:
            runs[-1].append(row)
        elif runs[-1]:
            runs.append([])
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("request_log")
    parser.add_argument("trace")
    parser.add_argument("--priority", type=int, default=1000)
    parser.add_argument("--gap-s", type=float, default=1.0, help="a pause this long between arrivals ends a phase")
    parser.add_argument("--slowest", type=int, default=8)
    parser.add_argument("--phase", choices=["overload", "idle"], default="overload",
                        help="the longest phase (overload), or the longest run of consecutive arrivals all of "
                             "--priority (the idle phase)")
    args = parser.parse_args()
    with open(args.trace) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    rows = read_log(args.request_log)
    phase = max(phases(rows, args.gap_s) if args.phase == "overload" else _runs_of(rows, args.priority), key=len)
    arrivals = [r["received_monotonic"] for r in phase]
    report = {"phase": args.phase, "host_gaps": host_gaps(steps, min(arrivals), max(arrivals)),
              **urgent_waits(phase, steps, args.priority, args.slowest)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
