"""Summarize a DFLASH2_STEP_TRACE file (one JSON line a step): what the steps cost, by kind (JSON out).

    DFLASH2_STEP_TRACE=$OUT/steps.jsonl W3_RUNS=poisson bash benchmarks/gpu_w3.sh   # the server inherits it
    python3 benchmarks/step_trace_report.py $OUT/steps.jsonl [--since-ms T]

Kinds: every step; decode-only steps; steps with prefill (by prefill tokens: <= 256, <= 1024, more); steps
with swaps; steps sampling an urgent first token (first_token_priority >= --urgent, default 1000). For each:
count, and p50 / p99 / max of device_ms (CUDA), plan_ms, launch_ms, finish_ms and the gap to the next step's
plan (host time between steps).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

FIELDS = ("device_ms", "plan_ms", "launch_ms", "finish_ms", "gap_ms")


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
    return names


def summarize(records: list[dict[str, Any]], urgent: int = 1000) -> dict[str, Any]:
    for record, following in zip(records, records[1:] + [None]):
        record["gap_ms"] = (None if following is None else
                            round(following["t_ms"] - record["t_ms"] - record["plan_ms"] - record["launch_ms"], 3))
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        for name in kinds(record, urgent):
            groups.setdefault(name, []).append(record)
    report: dict[str, Any] = {}
    for name, members in groups.items():
        entry: dict[str, Any] = {"steps": len(members)}
        for field in FIELDS:
            values = np.array([r[field] for r in members if r.get(field) is not None], dtype=float)
            if values.size:
                entry[field] = {"p50": round(float(np.percentile(values, 50)), 3),
                                "p99": round(float(np.percentile(values, 99)), 3), "max": round(float(values.max()), 3)}
        report[name] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--since-ms", type=float, default=0.0, help="only steps planned at or after this t_ms")
    parser.add_argument("--urgent", type=int, default=1000)
    args = parser.parse_args()
    with open(args.trace) as f:
        records = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(summarize([r for r in records if r["t_ms"] >= args.since_ms], args.urgent), indent=2))


if __name__ == "__main__":
    main()
