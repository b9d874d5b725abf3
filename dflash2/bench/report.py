"""The bench report: vLLM bench's fields plus our short ones, overall and per priority class.

Times in fields ending `_ms` are milliseconds; so are the short fields `latency_p50/p95/p99` (end to end)
and `ttft_p50/p95/p99`. Throughputs are per second of wall time of the whole run.
`gpu_utilization_avg` is the mean of the server's dflash2_gpu_utilization_perc samples (null on the CPU).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from dflash2.bench.client import RequestResult
from dflash2.bench.load import LoadConfig, LoadResult


def build_report(config: LoadConfig, load: LoadResult) -> dict[str, Any]:
    report: dict[str, Any] = {
        "url": config.url, "endpoint": config.endpoint, "model": config.model, "concurrency": config.concurrency,
        "request_rate": None if config.request_rate == float("inf") else config.request_rate,
        "duration": round(load.duration_s, 3),
    }
    report.update(summarize(load.results, load.duration_s))
    report["gpu_utilization_avg"] = _mean(load.gpu_utilization_samples)
    report["gpu_memory_utilization_avg"] = _mean(load.gpu_memory_samples)
    report["per_priority"] = {
        str(priority): summarize([r for r in load.results if r.priority == priority], load.duration_s)
        for priority in sorted({r.priority for r in load.results})}
    errors = Counter(r.error for r in load.results if not r.ok)
    report["errors"] = dict(errors.most_common(5))
    return report


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = len(results) - len(done)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(done), "failed": failed,
        "error_rate": failed / len(results) if results else 0.0,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for t in (r.tpot_s for r in done) if t is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.latency_s for r in done if r.latency_s is not None],
    }
    for name, values in series.items():
        summary.update(_stats_ms(name, values))
    summary.update({f"latency_p{q}": summary[f"p{q}_e2el_ms"] for q in (50, 95, 99)})
    summary.update({f"ttft_p{q}": summary[f"p{q}_ttft_ms"] for q in (50, 95, 99)})
    summary["throughput"] = {"requests_per_s": summary["request_throughput"],
                             "output_tokens_per_s": summary["output_throughput"]}
    return summary


def _stats_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"{key}_{name}_ms": None for key in ("mean", "median", "std", "p50", "p95", "p99")}
    ms = np.asarray(values_s) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p50_{name}_ms": float(np.percentile(ms, 50)),
            f"p95_{name}_ms": float(np.percentile(ms, 95)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def format_summary(report: dict[str, Any]) -> str:
    """A few human-readable lines for the terminal."""
    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    lines = [f"concurrency {report['concurrency']}: {report['completed']} completed, {report['failed']} failed "
             f"in {report['duration']:.1f} s; {report['request_throughput']:.2f} req/s, "
             f"{report['output_throughput']:.1f} output tok/s",
             f"  TTFT ms p50/p95/p99 {fmt(report['ttft_p50'])} / {fmt(report['ttft_p95'])} / {fmt(report['ttft_p99'])}"
             f"   latency ms p50/p95/p99 {fmt(report['latency_p50'])} / {fmt(report['latency_p95'])} / "
             f"{fmt(report['latency_p99'])}"]
    for priority, stats in report.get("per_priority", {}).items():
        lines.append(f"  priority {priority:>5}: {stats['completed']} done, {stats['failed']} failed, "
                     f"TTFT p50 {fmt(stats['ttft_p50'])} ms, latency p99 {fmt(stats['latency_p99'])} ms")
    for error, count in report.get("errors", {}).items():
        lines.append(f"  error x{count}: {error}")
    return "\n".join(lines)
