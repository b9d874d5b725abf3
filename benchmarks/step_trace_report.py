"""Summarize a DFLASH2_STEP_TRACE file (one JSON line a step): what the steps cost, by kind (JSON out).

    DFLASH2_STEP_TRACE=$OUT/steps.jsonl W3_RUNS=poisson bash benchmarks/gpu_w3.sh   # the server inherits it
    python3 benchmarks/step_trace_report.py $OUT/steps.jsonl [--since-ms T] [--until-ms T] [--window-from W7_JSON]

Kinds: every step; decode-only steps; steps with prefill (by prefill tokens: <= 256, <= 1024, more); steps
with swaps; steps replaying a CUDA graph or run eagerly (graph_replay, eager); steps sampling an urgent first
token (first_token_priority >= --urgent, default 1000). For each: count, and p50 / p99 / max of device_ms
(CUDA), plan_ms, launch_ms, finish_ms, the gap to the next step's plan (host time between steps) and the step's
wall time; the sums of device_ms and of wall time, and their shares of the whole window's sums.

A step's wall time is from its plan to the next step's plan (the last step's: to its results); the walls add
up to the window's span, so wall shares say where the run's time went. device_ms adds up to the time the
device was busy with steps (a step's clock starts when the device reaches it).

Besides the kinds (top-level keys, one per kind): "run" (the window's totals), "decode_by_rows" (decode-only
steps by decode rows: 1-64, 65-128, 129-256, 257-512, >512), "time_windows" (the window cut into 10 equal
spans of t_ms) and "slowest_steps" (the 10 with the longest wall).

--window-from reads "trace_window_ms" from a benchmark's result JSON (w7_throughput.py writes it when the
trace is on): only the steps of its timed run, not its warm-up.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

FIELDS = ("device_ms", "plan_ms", "launch_ms", "finish_ms", "gap_ms", "wall_ms")
ROW_BUCKETS = ((1, 64), (65, 128), (129, 256), (257, 512))  # and over 512
NUM_TIME_WINDOWS = 10
NUM_SLOWEST = 10


def kinds(record: dict[str, Any], urgent: int) -> list[str]:
    names = ["all"]
    tokens = record["prefill_tokens"]
    if tokens == 0:
        names.append("decode_only")
    else:
        names.append("prefill_le_256" if tokens <= 256 else "prefill_le_1024" if tokens <= 1024 else
                     "prefill_over_1024")
    if record["swap_out_pages"] or record["swap_in_pages"]:
        names.append("with_swaps")
    if (record["first_token_priority"] or 0) >= urgent:
        names.append("urgent_first_token")
    if "graph" in record:  # traces from before the field have neither
        names.append("eager" if record["graph"] is None else "graph_replay")
    return names


def annotate(records: list[dict[str, Any]]) -> None:
    """Add gap_ms and wall_ms to every record, from the next one in the file (a smaller t_ms there starts
    another trace appended to the same file: no next step)."""
    for record, following in zip(records, records[1:] + [None]):
        if following is not None and following["t_ms"] < record["t_ms"]:
            following = None
        if following is None:
            record["gap_ms"] = None
            done = record.get("done_mono_s")
            record["wall_ms"] = None if done is None else round((done - record["mono_s"]) * 1e3, 3)
        else:
            record["gap_ms"] = round(following["t_ms"] - record["t_ms"] - record["plan_ms"] - record["launch_ms"], 3)
            record["wall_ms"] = round(following["t_ms"] - record["t_ms"], 3)


def select(records: list[dict[str, Any]], since_ms: float, until_ms: float | None) -> list[dict[str, Any]]:
    return [r for r in records if r["t_ms"] >= since_ms and (until_ms is None or r["t_ms"] < until_ms)]


def values(records: list[dict[str, Any]], field: str) -> np.ndarray:
    return np.array([r[field] for r in records if r.get(field) is not None], dtype=float)


def total(records: list[dict[str, Any]], field: str) -> float | None:
    """The sum of a field where recorded; None where no record has it (device_ms on the CPU)."""
    found = values(records, field)
    return round(float(found.sum()), 3) if found.size else None


def p50(records: list[dict[str, Any]], field: str) -> float | None:
    found = values(records, field)
    return round(float(np.percentile(found, 50)), 3) if found.size else None


def share(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def kind_summary(records: list[dict[str, Any]], urgent: int) -> dict[str, Any]:
    """Per kind: steps, percentiles of FIELDS, the sums of device_ms and wall_ms and their shares of all."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        for name in kinds(record, urgent):
            groups.setdefault(name, []).append(record)
    whole = {field: total(records, field) for field in ("device_ms", "wall_ms")}
    report: dict[str, Any] = {}
    for name, members in groups.items():
        entry: dict[str, Any] = {"steps": len(members)}
        for field in FIELDS:
            found = values(members, field)
            if found.size:
                entry[field] = {"p50": round(float(np.percentile(found, 50)), 3),
                                "p99": round(float(np.percentile(found, 99)), 3), "max": round(float(found.max()), 3)}
        for field in ("device_ms", "wall_ms"):
            entry[f"{field}_sum"] = total(members, field)
            entry[f"{field}_share"] = share(entry[f"{field}_sum"], whole[field])
        report[name] = entry
    return report


def summarize(records: list[dict[str, Any]], urgent: int = 1000, since_ms: float = 0.0,
              until_ms: float | None = None) -> dict[str, Any]:
    """The per-kind summary of the steps planned in [since_ms, until_ms)."""
    annotate(records)
    return kind_summary(select(records, since_ms, until_ms), urgent)


def row_bucket(rows: int) -> str:
    if rows < 1:
        return "0"
    for low, high in ROW_BUCKETS:
        if rows <= high:
            return f"{low}-{high}"
    return f">{ROW_BUCKETS[-1][1]}"


def decode_by_rows(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode-only steps by their decode rows, smallest batches first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["decodes"]):
        if record["prefill_tokens"] == 0:
            groups.setdefault(row_bucket(record["decodes"]), []).append(record)
    report = {}
    for name, members in groups.items():
        rows = sum(r["decodes"] for r in members)
        wall = total(members, "wall_ms")
        report[name] = {"steps": len(members), "decode_rows_mean": round(rows / len(members), 1),
                        "device_ms_p50": p50(members, "device_ms"), "device_ms_sum": total(members, "device_ms"),
                        "wall_ms_p50": p50(members, "wall_ms"), "wall_ms_sum": wall,
                        "rows_per_s": round(rows / wall * 1e3, 1) if wall else None}
    return report


def time_windows(records: list[dict[str, Any]], count: int = NUM_TIME_WINDOWS) -> list[dict[str, Any]]:
    """The window cut into `count` equal spans of t_ms (from the first plan to the last step's end); each step
    counts in the span its plan falls in."""
    if not records:
        return []
    start = records[0]["t_ms"]
    end = max(r["t_ms"] + (r["wall_ms"] or 0.0) for r in records)
    width = (end - start) / count or 1.0
    spans: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    for record in records:
        spans[min(int((record["t_ms"] - start) / width), count - 1)].append(record)
    return [{"t_ms": [round(start + i * width, 1), round(start + (i + 1) * width, 1)], "steps": len(members),
             "decode_rows_mean": round(sum(r["decodes"] for r in members) / len(members), 1) if members else None,
             "decode_rows": sum(r["decodes"] for r in members),
             "prefill_tokens": sum(r["prefill_tokens"] for r in members),
             "device_ms_sum": total(members, "device_ms"), "wall_ms_sum": total(members, "wall_ms")}
            for i, members in enumerate(spans)]


def slowest_steps(records: list[dict[str, Any]], urgent: int, count: int = NUM_SLOWEST) -> list[dict[str, Any]]:
    """The `count` steps with the longest wall time, slowest first."""
    slowest = sorted((r for r in records if r["wall_ms"] is not None), key=lambda r: -r["wall_ms"])[:count]
    return [{"t_ms": r["t_ms"], "kind": kinds(r, urgent)[1], "decodes": r["decodes"],
             "prefill_tokens": r["prefill_tokens"], **{k: r[k] for k in FIELDS if k != "gap_ms"}} for r in slowest]


def run_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    device, wall = total(records, "device_ms"), total(records, "wall_ms")
    return {"steps": len(records), "t_ms": [records[0]["t_ms"], records[-1]["t_ms"]] if records else None,
            "device_ms_sum": device, "wall_ms_sum": wall, "device_busy_of_wall": share(device, wall),
            "decode_rows": sum(r["decodes"] for r in records),
            "prefill_tokens": sum(r["prefill_tokens"] for r in records),
            "host_ms_sum": {field: total(records, field) for field in ("plan_ms", "launch_ms", "finish_ms")}}


def report(records: list[dict[str, Any]], urgent: int = 1000, since_ms: float = 0.0,
           until_ms: float | None = None) -> dict[str, Any]:
    """The whole document: the kinds (top-level keys), then the run's totals, decode steps by rows, the time
    windows and the slowest steps."""
    annotate(records)
    window = select(records, since_ms, until_ms)
    return {**kind_summary(window, urgent), "run": run_totals(window), "decode_by_rows": decode_by_rows(window),
            "time_windows": time_windows(window), "slowest_steps": slowest_steps(window, urgent)}


def window_from(path: str) -> list[float]:
    """The [since, until] t_ms a benchmark's result JSON names (the first JSON object in the file)."""
    with open(path) as f:
        text = f.read()
    result, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    return result["trace_window_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--since-ms", type=float, default=0.0, help="only steps planned at or after this t_ms")
    parser.add_argument("--until-ms", type=float, default=None, help="only steps planned before this t_ms")
    parser.add_argument("--window-from", default=None, help="a result JSON whose trace_window_ms sets both")
    parser.add_argument("--urgent", type=int, default=1000)
    args = parser.parse_args()
    if args.window_from:
        args.since_ms, args.until_ms = window_from(args.window_from)
    with open(args.trace) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(report(records, args.urgent, args.since_ms, args.until_ms), indent=2))


if __name__ == "__main__":
    main()
