"""benchmarks/w3_request_log.py: the overload phase picked out of a request log, and its class's TTFT parts."""
from __future__ import annotations

import json

from benchmarks.w3_request_log import read_log, summarize


def _line(t: float, priority: int, ttft: float, queue: float) -> str:
    return json.dumps({"event": "request_finished", "received_monotonic": t, "priority": priority, "ttft_ms": ttft,
                       "queue_time_ms": queue, "http_in_ms": 0.5, "http_out_ms": 0.25})


def test_the_largest_phase_is_summarized_for_the_class(tmp_path):
    lines = [_line(0.0 + 0.1 * i, 1000, 3.0, 0.5) for i in range(3)]  # idle phase
    lines += [_line(5.0 + 0.01 * i, 1000 if i % 2 else 0, 4.5 + i, 1.0) for i in range(10)]  # overload
    lines.insert(4, "INFO some other line")
    lines.append(json.dumps({"event": "request_started", "received_monotonic": 9.0}))
    path = tmp_path / "stdout.log"
    path.write_text("\n".join(lines) + "\n")
    result = summarize(read_log(str(path)), 1000)
    assert result["phases"] == [3, 10] and result["requests"] == 5
    assert result["ttft_ms"]["p50"] == 9.5 and result["ttft_ms"]["max"] == 13.5  # 5.5, 7.5, 9.5, 11.5, 13.5
    assert result["queue_ms"]["p50"] == 1.0 and result["step_ms"]["p50"] == 8.5
    assert result["http_in_ms"]["max"] == 0.5
    assert (result["ttft_over_7_ms"], result["ttft_over_8_ms"]) == (4, 3)


def test_an_absent_class_has_no_statistics(tmp_path):
    path = tmp_path / "stdout.log"
    path.write_text(_line(0.0, 0, 3.0, 1.0) + "\n")
    assert summarize(read_log(str(path)), 1000) == {"phases": [1], "priority": 1000, "requests": 0}


def test_the_ttft_breakdown_splits_the_express_lanes_requests_from_the_others():
    """benchmarks/w3_server.py: with the request log's `express_lane`, the client TTFTs of the requests whose
    prompt ran in the lane and of the others get their own p50/p99, and each of the slowest says which it was."""
    from types import SimpleNamespace

    from benchmarks.w3_server import ttft_breakdown

    results, records = [], []
    for i, (ttft_ms, lane) in enumerate([(4.0, True), (6.0, True), (9.0, False), (11.0, False), (5.0, False)]):
        results.append(SimpleNamespace(request_id=f"r{i}", ok=True, ttft_s=ttft_ms / 1e3, started_at=10.0))
        records.append({"request_id": f"r{i}", "received_monotonic": 10.001, "first_sent_monotonic": 10.0 + (
            ttft_ms - 0.5) / 1e3, "express_lane": lane})
    summary = ttft_breakdown(records, results, slowest=2)
    assert summary["by_lane"] == {"lane": {"requests": 2, "ttft_p50_ms": 5.0, "ttft_p99_ms": 6.0},
                                  "main_steps": {"requests": 3, "ttft_p50_ms": 9.0, "ttft_p99_ms": 11.0}}
    assert [(row["ttft_ms"], row["lane"]) for row in summary["slowest"]] == [(11.0, False), (9.0, False)]
    for record in records:
        del record["express_lane"]  # a server without the lane (or an older log): no split
    assert "by_lane" not in ttft_breakdown(records, results)
