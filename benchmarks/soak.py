"""Soak (issue 47): `dflash2 serve` under load at twice its measured capacity for N minutes; reports the resident
memory of the server's processes over time and how every request was answered. Prints JSON.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--server-arg=--dtype --server-arg=float32 ...]
                                        [--max-tokens 32] [--output FILE]

First a closed loop of 8 in flight for 20 s measures the capacity (completed requests per second); then Poisson
arrivals at twice that rate (up to 256 in flight) for --minutes, while a thread samples the RSS of the server and
its engine process every 10 s. Passing: RSS growth from the first sample after warm-up to the last under 5%, and
every request answered 200 or 503 (the queue bound's refusal, with Retry-After); anything else is a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash2.bench.dataset import load_dataset  # noqa: E402
from dflash2.bench.load import LoadConfig, run_async, run_load  # noqa: E402
from dflash2.bench.server_process import ServerProcess  # noqa: E402

DATASET = Path(__file__).resolve().parent / "data" / "cpu_server.jsonl"
RSS_INTERVAL_S = 10.0
MAX_RSS_GROWTH = 0.05


def tree_rss_bytes(pid: int) -> dict[int, int]:
    """RSS of a process and every process below it, by pid."""
    sizes, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            sizes[current] = int(next(line.split()[1] for line in status.splitlines()
                                      if line.startswith("VmRSS:"))) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            pass  # gone meanwhile
    return sizes


def sample_rss(pid: int, stop: threading.Event, samples: list[dict[str, Any]], started: float) -> None:
    while not stop.wait(RSS_INTERVAL_S):
        sizes = tree_rss_bytes(pid)
        samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mib": round(sum(sizes.values()) / 2**20, 1),
                        "processes": len(sizes)})


def answered(results: list[Any]) -> dict[str, int]:
    counts = {"200": 0, "503": 0, "other": 0}
    for result in results:
        if result.ok:
            counts["200"] += 1
        elif result.error and result.error.startswith("HTTP 503"):
            counts["503"] += 1
        else:
            counts["other"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--server-arg", action="append", default=[], help="one more flag for the server (repeat)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    items = load_dataset(str(DATASET), args.max_tokens)
    server = ServerProcess(*args.server_arg).start(600)
    try:
        base = dict(url=server.url, timeout_s=300.0, ignore_eos=True, progress=False, scrape_metrics=False)
        warm = run_async(run_load(LoadConfig(concurrency=8, duration_s=20.0, **base), items))
        capacity = sum(r.ok for r in warm.results) / warm.duration_s
        stop, samples, started = threading.Event(), [], time.monotonic()
        sampler = threading.Thread(target=sample_rss, args=(server.process.pid, stop, samples, started), daemon=True)
        sampler.start()
        load = run_async(run_load(LoadConfig(concurrency=256, request_rate=2 * capacity,
                                             duration_s=60.0 * args.minutes, **base), items))
        stop.set()
        sampler.join()
    finally:
        server.stop()
    counts = answered(load.results)
    first = next((s for s in samples if s["t_s"] >= 60.0), samples[0] if samples else None)
    growth = (samples[-1]["rss_mib"] - first["rss_mib"]) / first["rss_mib"] if first else None
    report = {"benchmark": "soak", "minutes": args.minutes, "server_args": args.server_arg,
              "capacity_req_per_s": round(capacity, 2), "offered_req_per_s": round(2 * capacity, 2),
              "requests": len(load.results), "answered": counts, "rss": samples,
              "rss_growth": None if growth is None else round(growth, 4),
              "passed": counts["other"] == 0 and growth is not None and growth < MAX_RSS_GROWTH}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
