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
