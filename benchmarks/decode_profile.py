"""Where a decode step's device time goes: `--batch` requests decoding together (dummy weights, CUDA graphs as
served), `--steps` steps under torch.profiler; prints JSON with each kernel's calls and microseconds per step,
the sum, and the wall time per step.

    python3 benchmarks/decode_profile.py --model llama-3-8b --weights int4            # W2's step (batch 1)
    python3 benchmarks/decode_profile.py --model qwen3-0.6b --batch 32 --prompt-len 256   # a W3 decode step

Kernel times come from CUPTI (kernels inside graph replays included); overlap between kernels (programmatic
dependent launch) makes their sum larger than the step. So the JSON also gives each kernel's exposed time: kernels
in start order, each one is charged for how far it moves the latest end seen so far (max(0, end - latest end)),
which sums to the time the device was busy; a kernel that runs entirely under another one is charged nothing.
`--timeline FILE` writes every kernel of the last profiled step (name, start and end in us from the step's first
kernel) as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import sync  # noqa: E402
from benchmarks.latency import WEIGHT_CHOICES, quantize_dummy_weights  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402


def kernel_table(prof, steps: int) -> list[dict]:
    """Device kernels of a profile: name, calls and microseconds per step, largest first."""
    total_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.device_time
            calls[event.name] += 1
    rows = [{"kernel": name[:90], "calls_per_step": round(calls[name] / steps, 2),
             "us_per_step": round(us / steps, 1)} for name, us in total_us.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device kernel, in start order."""
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events)


def exposed_table(events: list[tuple[float, float, str]], steps: int) -> tuple[list[dict], float]:
    """Each kernel's exposed microseconds per step (see the module docstring), largest first, and their sum."""
    exposed: dict[str, float] = defaultdict(float)
    latest = None
    for start, end, name in events:
        if latest is None:
            latest = start
        exposed[name] += max(0.0, end - max(latest, start))
        latest = max(latest, end)
    rows = [{"kernel": name[:90], "exposed_us_per_step": round(us / steps, 1)} for name, us in exposed.items()]
    return sorted(rows, key=lambda r: -r["exposed_us_per_step"]), round(sum(exposed.values()) / steps, 1)


def write_timeline(events: list[tuple[float, float, str]], steps: int, path: str) -> None:
    """The last step's kernels (the events split into `steps` equal runs: every step launches the same ones)."""
    per_step = len(events) // steps
    last = events[-per_step:]
    origin = last[0][0]
    with open(path, "w") as f:
        for start, end, name in last:
            f.write(json.dumps({"kernel": name[:60], "start_us": round(start - origin, 2),
                                "end_us": round(end - origin, 2)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_CHOICES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeline", default=None, help="write the last step's kernels here (JSON lines)")
    args = parser.parse_args()
    quantize_dummy_weights(args.weights)
    llm = LLM(args.model, load_format="dummy", device=args.device, max_num_seqs=max(4, args.batch),
              max_model_len=args.prompt_len + 3 * args.steps + 64, enable_prefix_caching=False)
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=3 * args.steps + 32, ignore_eos=True, temperature=0)
    for _ in range(args.batch):
        prompt = torch.randint(100, 20000, (args.prompt_len,), generator=generator).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params)
    for _ in range(args.steps):  # prefill, then decode steps (graphs captured and warm)
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    kernels = kernel_table(prof, args.steps)
    events = kernel_events(prof)
    exposed, busy_us = exposed_table(events, args.steps)
    if args.timeline:
        write_timeline(events, args.steps, args.timeline)
    print(json.dumps({"model": args.model, "weights": args.weights, "batch": args.batch,
                      "prompt_len": args.prompt_len, "steps": args.steps, "wall_ms_per_step": round(wall_ms, 3),
                      "kernel_us_per_step": round(sum(r["us_per_step"] for r in kernels), 1),
                      "kernel_launches_per_step": round(sum(r["calls_per_step"] for r in kernels), 1),
                      "busy_us_per_step": busy_us, "exposed": exposed[:args.top],
                      "kernels": kernels[:args.top]}, indent=1))
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
