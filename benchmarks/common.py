"""Shared by the GPU benchmarks: where the peer's JSON and our results go."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def device_name() -> str:
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
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if save:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        name = f"{result['workload']}_{result['date']}_{time.strftime('%H%M%S')}.json"
        with open(os.path.join(RESULTS_DIR, name), "w") as f:
            f.write(text + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
