"""Shared by the benchmarks: where the peer's JSON and our results go, and how a report is printed and kept.
(torch is imported where it is used: the W3 client scripts import this module too.)"""
from __future__ import annotations

import json
import os
import time
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def finish(result: dict[str, Any], peer_json: str | None, save: bool) -> None:
    """Attach the peer's JSON (same run), print, and keep a copy under benchmarks/results/."""
    result.setdefault("gpu", device_name())
    result.setdefault("date", time.strftime("%Y-%m-%d"))
    if peer_json and os.path.exists(peer_json):
        with open(peer_json) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if lines:
            result["peer"] = json.loads(lines[-1])
            key = "out_tok_s" if "out_tok_s" in result else "tok_s"
            if key in result["peer"]:
                result["ratio_to_peer"] = round(result[key] / result["peer"][key], 2)
    name = f"{result['workload']}_{result['date']}_{time.strftime('%H%M%S')}.json"
    print_report(result, os.path.join(RESULTS_DIR, name) if save else None)


def print_report(report: dict[str, Any], output: str | None) -> None:
    """Print a report as indented JSON, and write the same text to `output` (its folder made) when given."""
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            f.write(text + "\n")


def print_tune(rows: list[dict[str, Any]], summary: dict[str, Any], output: str | None) -> None:
    """A tune's end: its summary on one line, and every row and the summary as JSON to `output` when given."""
    print("summary", json.dumps(summary))
    if output:
        with open(output, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
