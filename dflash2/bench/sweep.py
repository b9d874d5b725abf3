"""--sweep: one load level after another, and a chart of p95 latency and throughput against concurrency.

The knee is the lowest concurrency whose output throughput reaches KNEE_FRACTION of the best level's:
past it, more concurrency buys little throughput and mostly adds latency.
"""
from __future__ import annotations

from typing import Any

KNEE_FRACTION = 0.9


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated concurrency levels like 1,4,16,64, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"--sweep levels must be positive integers, got {text!r}")
    return sorted(set(levels))


def find_knee(reports: list[dict[str, Any]]) -> int | None:
    throughputs = [r["output_throughput"] for r in reports]
    if not throughputs or max(throughputs) <= 0:
        return None
    best = max(throughputs)
    for report in reports:
        if report["output_throughput"] >= KNEE_FRACTION * best:
            return report["concurrency"]
    return None


def plot_sweep(reports: list[dict[str, Any]], knee: int | None, path: str) -> None:
    """Write a PNG: p95 end-to-end latency (left axis) and output throughput (right axis) per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in reports]
    latency = [r["latency_p95"] if r["latency_p95"] is not None else float("nan") for r in reports]
    throughput = [r["output_throughput"] for r in reports]
    fig, left = plt.subplots(figsize=(7, 4.5))
    left.plot(levels, latency, "o-", color="tab:red", label="p95 latency (ms)")
    left.set_xlabel("concurrency")
    left.set_ylabel("p95 end-to-end latency (ms)", color="tab:red")
    if len(levels) > 1:
        left.set_xscale("log", base=2)
    left.set_xticks(levels, [str(level) for level in levels])
    right = left.twinx()
    right.plot(levels, throughput, "s-", color="tab:blue", label="throughput (tok/s)")
    right.set_ylabel("output throughput (tok/s)", color="tab:blue")
    if knee is not None:
        left.axvline(knee, color="gray", linestyle="--")
        left.text(knee, 0.03, f" knee: concurrency {knee}", transform=left.get_xaxis_transform(), color="gray")
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.9))
    left.set_title("dflash2 bench sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
