"""benchmarks/step_trace_report.py: the sums by kind, decode steps by rows, time windows and slowest steps."""
from __future__ import annotations

import json

from benchmarks.step_trace_report import annotate, report, window_from


def step(t: float, prefill_tokens: int, decodes: int, device: float, done_after_ms: float | None = None) -> dict:
    record = {"t_ms": t, "mono_s": 1.0 + t / 1e3, "plan_ms": 0.5, "launch_ms": 1.0, "finish_ms": 0.25,
              "device_ms": device, "decodes": decodes, "prefill_chunks": int(prefill_tokens > 0),
              "prefill_tokens": prefill_tokens, "swap_out_pages": 0, "swap_in_pages": 0, "preempted": 0,
              "top_priority": 0, "first_token_priority": None}
    if done_after_ms is not None:
        record["done_mono_s"] = record["mono_s"] + done_after_ms / 1e3
    return record


def trace() -> list[dict]:
    # walls: 12, 6, 8, 10 to the next plan; the last one's, 4, to its results
    return [step(0.0, 300, 0, 10.0), step(12.0, 0, 64, 5.0), step(18.0, 0, 65, 6.0), step(26.0, 0, 600, 9.0),
            step(36.0, 0, 100, 7.0, done_after_ms=4.0)]


def test_sums_and_shares_by_kind():
    summary = report(trace())
    assert {k: summary["all"][k] for k in ("steps", "device_ms_sum", "device_ms_share", "wall_ms_sum",
                                           "wall_ms_share")} == {
        "steps": 5, "device_ms_sum": 37.0, "device_ms_share": 1.0, "wall_ms_sum": 40.0, "wall_ms_share": 1.0}
    decode = summary["decode_only"]
    assert (decode["device_ms_sum"], decode["device_ms_share"], decode["wall_ms_sum"], decode["wall_ms_share"]) \
        == (27.0, 0.7297, 28.0, 0.7)
    assert summary["prefill_le_1024"]["wall_ms_sum"] == 12.0 and summary["prefill_le_1024"]["wall_ms_share"] == 0.3
    assert summary["all"]["wall_ms"] == {"p50": 8.0, "p99": 11.92, "max": 12.0}
    assert summary["run"]["device_busy_of_wall"] == 0.925
    assert (summary["run"]["decode_rows"], summary["run"]["prefill_tokens"]) == (829, 300)


def test_decode_steps_by_rows():
    assert report(trace())["decode_by_rows"] == {
        "1-64": {"steps": 1, "decode_rows_mean": 64.0, "device_ms_p50": 5.0, "device_ms_sum": 5.0,
                 "wall_ms_p50": 6.0, "wall_ms_sum": 6.0, "rows_per_s": 10666.7},
        "65-128": {"steps": 2, "decode_rows_mean": 82.5, "device_ms_p50": 6.5, "device_ms_sum": 13.0,
                   "wall_ms_p50": 6.0, "wall_ms_sum": 12.0, "rows_per_s": 13750.0},
        ">512": {"steps": 1, "decode_rows_mean": 600.0, "device_ms_p50": 9.0, "device_ms_sum": 9.0,
                 "wall_ms_p50": 10.0, "wall_ms_sum": 10.0, "rows_per_s": 60000.0}}


def test_time_windows_and_slowest_steps():
    summary = report(trace())
    windows = summary["time_windows"]  # 0-40 ms in spans of 4
    assert [w["steps"] for w in windows] == [1, 0, 0, 1, 1, 0, 1, 0, 0, 1]
    assert windows[9] == {"t_ms": [36.0, 40.0], "steps": 1, "decode_rows_mean": 100.0, "decode_rows": 100,
                          "prefill_tokens": 0, "device_ms_sum": 7.0, "wall_ms_sum": 4.0}
    assert windows[1]["decode_rows_mean"] is None and windows[1]["wall_ms_sum"] is None
    slowest = summary["slowest_steps"]
    assert [s["t_ms"] for s in slowest] == [0.0, 26.0, 18.0, 12.0, 36.0]
    assert slowest[0] == {"t_ms": 0.0, "kind": "prefill_le_1024", "decodes": 0, "prefill_tokens": 300,
                          "device_ms": 10.0, "plan_ms": 0.5, "launch_ms": 1.0, "finish_ms": 0.25, "wall_ms": 12.0}


def test_a_window_keeps_the_walls_measured_to_steps_outside_it():
    summary = report(trace(), since_ms=12.0, until_ms=36.0)
    assert summary["run"]["steps"] == 3 and summary["run"]["wall_ms_sum"] == 24.0  # 6 + 8 + 10 (to t = 36)
    assert summary["run"]["device_ms_sum"] == 20.0 and "prefill_le_1024" not in summary


def test_a_second_trace_appended_to_the_file_ends_the_first_one_at_its_results():
    records = [step(5.0, 0, 8, 1.0, done_after_ms=2.0), step(1.0, 0, 8, 1.0)]
    annotate(records)
    assert (records[0]["wall_ms"], records[0]["gap_ms"]) == (2.0, None)
    assert records[1]["wall_ms"] is None


def test_window_from_reads_the_first_json_object_of_a_result(tmp_path):
    path = tmp_path / "w7.json"
    path.write_text("a log line\n" + json.dumps({"out_tok_s": 1.0, "trace_window_ms": [10.5, 99.0]}, indent=2)
                    + "\ntrailing text\n")
    assert window_from(str(path)) == [10.5, 99.0]
