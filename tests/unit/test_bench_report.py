"""The bench's dataset reader, report statistics, knee and chart (no server)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from dflash2.bench.client import RequestResult, request_body
from dflash2.bench.dataset import BenchItem, load_dataset
from dflash2.bench.load import LoadConfig, LoadResult
from dflash2.bench.report import build_report, summarize
from dflash2.bench.sweep import find_knee, parse_levels, plot_sweep


def result(priority: int, ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if ok and tokens > 1 else []
    return RequestResult(priority, ok=ok, error=None if ok else "HTTP 500: boom", ttft_s=ttft if ok else None,
                         latency_s=latency if ok else None, itl_s=gaps, prompt_tokens=10 if ok else 0,
                         output_tokens=tokens if ok else 0)


def test_the_shipped_sample_has_the_w3_priority_mix():
    items = load_dataset(None)
    assert len(items) == 100
    assert Counter(item.priority for item in items) == {0: 70, 100: 20, 1000: 10}
    assert all(isinstance(item.prompt, str) and item.max_tokens >= 1 for item in items)
    assert {item.max_tokens for item in load_dataset(None, max_tokens=5)} == {5}


def test_dataset_lines_are_checked(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 4}) + "\n\n")
    assert load_dataset(path) == [BenchItem([1, 2, 3], 4, 0)]
    for bad, words in (({"max_tokens": 3}, "prompt"), ({"prompt": "x", "priority": 70000}, "priority"),
                       ({"prompt": "x", "max_tokens": 0}, "max_tokens")):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=words):
            load_dataset(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=":1: not valid JSON"):
        load_dataset(path)


def test_summary_fields_and_percentiles():
    results = [result(0, 0.1 * (i + 1), 1.0 + i, 5) for i in range(10)] + [result(0, 0, 0, 0, ok=False)]
    summary = summarize(results, duration_s=10.0)
    assert (summary["completed"], summary["failed"]) == (10, 1)
    assert summary["error_rate"] == pytest.approx(1 / 11)
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(5.0)
    assert summary["median_ttft_ms"] == pytest.approx(550.0)
    assert summary["p99_e2el_ms"] == summary["latency_p99"]
    assert summary["ttft_p50"] == summary["p50_ttft_ms"]
    assert summary["mean_tpot_ms"] == pytest.approx(summary["mean_itl_ms"])
    assert summary["throughput"] == {"requests_per_s": 1.0, "output_tokens_per_s": 5.0}


def test_report_breaks_down_by_priority_and_has_no_gpu_figure_without_samples():
    results = [result(0, 0.5, 2.0, 4), result(0, 0.4, 1.5, 4), result(1000, 0.05, 0.5, 4),
               result(100, 0, 0, 0, ok=False)]
    config = LoadConfig(url="http://x", num_prompts=4)
    report = build_report(config, LoadResult(results, 2.0, [], []))
    assert set(report["per_priority"]) == {"0", "100", "1000"}
    assert report["per_priority"]["1000"]["ttft_p50"] == pytest.approx(50.0)
    assert report["per_priority"]["100"]["error_rate"] == 1.0
    assert report["gpu_utilization_avg"] is None
    assert report["errors"] == {"HTTP 500: boom": 1}
    gpu = build_report(config, LoadResult(results, 2.0, [50.0, 70.0], [0.5]))
    assert gpu["gpu_utilization_avg"] == 60.0


def test_load_config_checks():
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(url="http://x")
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(url="http://x", duration_s=1, concurrency=0)


def test_request_bodies_per_endpoint():
    item = BenchItem("Hi", 8, 100)
    assert request_body("/v1/completions", item, None, True)["stream_options"] == {"include_usage": True}
    chat = request_body("/v1/chat/completions", item, "m", False)
    assert chat["messages"] == [{"role": "user", "content": "Hi"}] and chat["model"] == "m"
    assert request_body("/generate", BenchItem([1, 2], 8), None, False)["prompt_token_ids"] == [1, 2]
    assert request_body("/generate", item, None, False)["priority"] == 100


def test_sweep_levels_knee_and_chart(tmp_path):
    assert parse_levels("16,1,4") == [1, 4, 16]
    with pytest.raises(ValueError):
        parse_levels("1,x")
    reports = [{"concurrency": c, "output_throughput": t, "latency_p95": l}
               for c, t, l in ((1, 10.0, 100.0), (4, 35.0, 150.0), (16, 38.0, 400.0), (64, 39.0, 1600.0))]
    assert find_knee(reports) == 16
    path = tmp_path / "chart.png"
    plot_sweep(reports, 16, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
