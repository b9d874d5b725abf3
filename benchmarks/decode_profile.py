"""Where a decode step's device time goes: `--batch` requests decoding together (dummy weights, CUDA graphs as
served), `--steps` steps under torch.profiler; prints JSON with each kernel's calls and microseconds per step,
the sum, and the wall time per step.

    python3 benchmarks/decode_profile.py --model llama-3-8b --weights int4            # W2's step (batch 1)
    python3 benchmarks/decode_profile.py --model qwen3-0.6b --batch 32 --prompt-len 256   # a W3 decode step
    python3 benchmarks/decode_profile.py --model llama-3-8b --weights int4 --prefill      # W2's first token

`--prefill`: each profiled "step" is a new request's whole prefill (`--prompt-len` tokens, one new token), so the
table is W2's first-token step; the wall time is from adding the request to its first token.

Kernel times come from CUPTI (kernels inside graph replays included); overlap between kernels (programmatic
dependent launch) makes their sum larger than the step. So the JSON also gives each kernel's exposed time
(kernel_times.py): how far it moves the latest kernel end, summing to the time the device was busy.
`--timeline FILE` writes every kernel of the last profiled step (name, start and end in us from the step's first
kernel) as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import sync  # noqa: E402
from benchmarks.kernel_times import exposed_table, kernel_events, kernel_table, write_timeline  # noqa: E402
from benchmarks.latency import WEIGHT_CHOICES, quantize_dummy_weights  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_CHOICES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's (default: the batch, at least 4); W7's 512 gives its graph buckets")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeline", default=None, help="write the last step's kernels here (JSON lines)")
    parser.add_argument("--prefill", action="store_true", help="profile new requests' prefill steps instead")
    parser.add_argument("--timeline-steps", type=int, default=1,
                        help="the last this many steps in the timeline (2: the boundary between two steps' graphs)")
    args = parser.parse_args()
    quantize_dummy_weights(args.weights)
    llm = LLM(args.model, load_format="dummy", device=args.device, max_num_seqs=args.max_num_seqs or max(4, args.batch),
              max_model_len=args.prompt_len + 3 * args.steps + 64, enable_prefix_caching=False)
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    if args.prefill:
        return profile_prefills(llm, args, generator)
    params = SamplingParams(max_tokens=3 * args.steps + 32, ignore_eos=True, temperature=0)
    for _ in range(args.batch):
        prompt = torch.randint(100, 20000, (args.prompt_len,), generator=generator).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params)
    for _ in range(args.steps):  # prefill, then decode steps (graphs captured and warm)
        engine.step()
    wall_ms = wall_ms_per_step(engine.step, args.steps)
    report(profiled(engine.step, args), args, wall_ms)
    while engine.has_unfinished():
        engine.step()


def wall_ms_per_step(step, steps: int) -> float:
    """Milliseconds of wall time per call of step, over `steps` calls (the device synchronized around them)."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / steps


def profiled(step, args) -> list[tuple[float, float, str]]:
    """The device kernels of `args.steps` calls of step under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    return kernel_events(prof)


def profile_prefills(llm: LLM, args, generator: torch.Generator) -> None:
    """--prefill: each step adds a request of args.prompt_len tokens and runs until its one new token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)

    def prefill() -> None:
        prompt = torch.randint(100, 20000, (args.prompt_len,), generator=generator).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params)
        while engine.has_unfinished():
            engine.step()

    for _ in range(3):
        prefill()
    wall_ms = wall_ms_per_step(prefill, args.steps)
    report(profiled(prefill, args), args, wall_ms)


def report(events: list[tuple[float, float, str]], args, wall_ms: float) -> None:
    """Prints the JSON (module docstring); writes the timeline."""
    kernels = kernel_table(events, args.steps)
    exposed, busy_us = exposed_table(events, args.steps)
    if args.timeline:
        write_timeline(events, args.steps, args.timeline, args.timeline_steps)
    print(json.dumps({"model": args.model, "weights": args.weights, "batch": args.batch, "prefill": args.prefill,
                      "max_num_seqs": args.max_num_seqs,
                      "prompt_len": args.prompt_len, "steps": args.steps, "wall_ms_per_step": round(wall_ms, 3),
                      "kernel_us_per_step": round(sum(r["us_per_step"] for r in kernels), 1),
                      "kernel_launches_per_step": round(sum(r["calls_per_step"] for r in kernels), 1),
                      "busy_us_per_step": busy_us, "exposed": exposed[:args.top],
                      "kernels": kernels[:args.top]}, indent=1))


if __name__ == "__main__":
    main()
