"""Host cost of a step that prefills a prompt (W3's urgent TTFT floor): how long launching it takes on the
host, and where that time goes (cProfile over the steps, top functions by own time).

    python3 benchmarks/prefill_host.py [--model qwen3-0.6b] [--prompt-len 256] [--repeats 20] [--decodes 24]

With --decodes N, N requests keep decoding beside each prompt (W3's mixed steps); the profile then covers
whole Engine.step() calls (plan, launch, commit). Prints JSON: the mean/min launch seconds of the prompt's
step (Engine.last_launch_seconds), the mean plan/launch/finish of every profiled step, and the top functions.
On the CPU it runs too (the CPU forward is then most of the launch).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash2 import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--decodes", type=int, default=0, help="requests decoding beside each prompt")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", max_num_seqs=max(32, args.decodes + 2), max_model_len=1024,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    background = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0)
    for i in range(args.decodes):  # short prompts that then decode for the whole run
        engine.add_request({"prompt_token_ids": [100 + i] * 16}, background)
    for _ in range(3):
        engine.step()
    step_times: list[tuple[float, float, float]] = []

    def timed_step() -> None:
        engine.step()
        step_times.append((engine.last_plan_seconds, engine.last_launch_seconds, engine.last_finish_seconds))

    def one_prefill(seed: int) -> float:
        prompt = {"prompt_token_ids": [(seed * 7919 + i * 31) % 30000 + 100 for i in range(args.prompt_len)]}
        engine.add_request(prompt, params)
        timed_step()  # plan + launch the prefill (its token is committed by the next call)
        launch = engine.last_launch_seconds
        for _ in range(3):  # its token arrives (and, with --decodes, a few decode-only steps)
            timed_step()
        while not args.decodes and engine.has_unfinished():
            engine.step()
        return launch

    for seed in range(3):  # warm-up: compile every kernel variant
        one_prefill(seed)
    times = [one_prefill(100 + i) for i in range(args.repeats)]
    steps = step_times[-4 * args.repeats:]
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(5):
        one_prefill(1000 + i)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue(), file=sys.stderr)
    print(json.dumps({"model": args.model, "prompt_len": args.prompt_len,
                      "launch_ms_mean": round(sum(times) / len(times) * 1e3, 3),
                      "launch_ms_min": round(min(times) * 1e3, 3), "decodes": args.decodes,
                      "all_steps_ms_mean": {name: round(sum(t[i] for t in steps) / len(steps) * 1e3, 3)
                                            for i, name in enumerate(("plan", "launch", "finish"))},
                      "cuda_graphs": engine.runner.graphs is not None,
                      "device": str(engine.model.device)}, indent=2))


if __name__ == "__main__":
    main()
