"""`dflash2 top`: a live terminal view of a running server, from its /metrics (the rich library).

    dflash2 top [--url http://127.0.0.1:8000] [--interval 2] [--once]

Per model: requests running, waiting and swapped, KV pages used and cached, output tokens per second, TTFT and
inter-token latency percentiles; TTFT per priority class; the pool; the GPU's memory, utilization and power. Rates
and percentiles cover the last interval (with --once: everything since the server started). Percentiles come from
the histograms' buckets (the upper bound of the bucket holding the quantile).
"""
from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from dflash2.cli.args import add_flag

QUANTILES = (0.5, 0.99)
WIDE_OUTPUT = 150  # columns of --once's view when stdout is not a terminal


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("top", help="a live view of a running server (from its /metrics)")
    add_flag(parser, "--url", default="http://127.0.0.1:8000", help="the server (or its --metrics-port)")
    add_flag(parser, "--interval", type=float, default=2.0, help="seconds between refreshes")
    add_flag(parser, "--once", action="store_true", help="print one view (since the server started) and exit")
    add_flag(parser, "--log-level", default="warning")
    parser.set_defaults(func=run)


@dataclass
class Snapshot:
    """What one scrape of /metrics says: samples by (name, labels), histograms' buckets."""

    at: float
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @classmethod
    def scrape(cls, url: str) -> Snapshot:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
        snapshot = cls(time.monotonic())
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                snapshot.values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return snapshot

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """label dict (as a sorted tuple) -> value, for one sample name."""
        return {labels: value for (sample, labels), value in self.values.items() if sample == name}

    def get(self, name: str, **labels: str) -> float:
        wanted = set(labels.items())
        return sum(value for (sample, sample_labels), value in self.values.items()
                   if sample == name and wanted <= set(sample_labels))

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets (le, count), summed over the series matching `labels`."""
        counts: dict[float, float] = defaultdict(float)
        wanted = set(labels.items())
        for (sample, sample_labels), value in self.values.items():
            if sample == f"{name}_bucket" and wanted <= set(sample_labels):
                counts[float(dict(sample_labels)["le"])] += value
        return sorted(counts.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q (None: no observation; inf: past the last bound)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    return next(le for le, count in buckets if count >= target)


def _delta(new: list[tuple[float, float]], old: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if old is None:
        return new
    previous = dict(old)
    return [(le, count - previous.get(le, 0.0)) for le, count in new]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "inf" if math.isinf(seconds) else f"{1000 * seconds:.0f}"


def render(now: Snapshot, before: Snapshot | None) -> Any:
    """The view: a rich renderable."""
    from rich.console import Group
    from rich.table import Table

    elapsed = max(now.at - before.at, 1e-9) if before is not None else None
    models = sorted({dict(labels)["model_name"] for labels in now.series("dflash2_num_requests_running")})
    table = Table(title="models", expand=True)
    for column in ("model", "running", "waiting", "swapped", "KV used", "KV cached", "out tok/s", "TTFT p50/p99 ms",
                   "ITL p50/p99 ms", "preemptions"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model in models:
        def series_delta(name: str) -> list[tuple[float, float]]:
            return _delta(now.buckets(name, model_name=model),
                          before.buckets(name, model_name=model) if before is not None else None)
        generated = now.get("dflash2_generation_tokens_total", model_name=model)
        rate = "-" if elapsed is None else \
            f"{(generated - before.get('dflash2_generation_tokens_total', model_name=model)) / elapsed:.1f}"
        ttft, itl = series_delta("dflash2_time_to_first_token_seconds"), series_delta("dflash2_inter_token_latency_seconds")
        table.add_row(model, *(f"{now.get(name, model_name=model):.0f}" for name in (
            "dflash2_num_requests_running", "dflash2_num_requests_waiting", "dflash2_num_requests_swapped")),
            f"{now.get('dflash2_kv_cache_model_pages', model_name=model, state='used'):.0f}",
            f"{now.get('dflash2_kv_cache_model_pages', model_name=model, state='cached'):.0f}", rate,
            " / ".join(_ms(quantile(ttft, q)) for q in QUANTILES), " / ".join(_ms(quantile(itl, q)) for q in QUANTILES),
            f"{now.get('dflash2_num_preemptions_total', model_name=model):.0f}")
    priorities = Table(title="TTFT by priority class", expand=True)
    for column in ("priority class", "requests", "p50 ms", "p99 ms"):
        priorities.add_column(column, justify="right")
    classes = sorted({dict(labels)["priority_class"] for labels in
                      now.series("dflash2_time_to_first_token_by_priority_seconds_count")}, key=int)
    for priority in classes:
        buckets = _delta(now.buckets("dflash2_time_to_first_token_by_priority_seconds", priority_class=priority),
                         before.buckets("dflash2_time_to_first_token_by_priority_seconds", priority_class=priority)
                         if before is not None else None)
        count = buckets[-1][1] if buckets else 0
        priorities.add_row(priority, f"{count:.0f}", *(_ms(quantile(buckets, q)) for q in QUANTILES))
    pool = Table(title="pool and device", expand=True)
    pool.add_column("what")
    pool.add_column("value", justify="right")
    total = now.get("dflash2_kv_cache_total_pages")
    pool.add_row("KV pages used / total", f"{now.get('dflash2_kv_cache_used_pages'):.0f} / {total:.0f}")
    pool.add_row("KV use, last minute", f"{100 * now.get('dflash2_avg_kv_cache_utilization'):.1f}%")
    for labels, used in sorted(now.series("dflash2_gpu_memory_used_bytes").items()):
        gpu = dict(labels)["gpu"]
        pool.add_row(f"GPU {gpu} memory", f"{used / 2**30:.1f} GiB")
        pool.add_row(f"GPU {gpu} utilization", f"{now.get('dflash2_gpu_utilization', gpu=gpu):.0f}%")
        pool.add_row(f"GPU {gpu} power", f"{now.get('dflash2_gpu_power_draw_watts', gpu=gpu):.0f} W")
    if not now.series("dflash2_gpu_memory_used_bytes"):
        pool.add_row("GPU", "none (CPU)")
    return Group(table, priorities, pool)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0, got {args.interval:g}")
    try:
        snapshot = Snapshot.scrape(args.url)
    except Exception as e:  # noqa: BLE001 - no server there: say so
        raise ValueError(f"cannot read {args.url}/metrics: {e}") from None
    if args.once:
        console = Console()
        if not console.is_terminal:  # a file or a pipe: wide enough for every column
            console = Console(width=WIDE_OUTPUT)
        console.print(render(snapshot, None))
        return 0
    with Live(render(snapshot, None), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                now = Snapshot.scrape(args.url)
                live.update(render(now, snapshot))
                snapshot = now
        except KeyboardInterrupt:
            return 0
