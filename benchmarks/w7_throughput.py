"""W7: 8B throughput on a ShareGPT-like request set (llama-3-8b dummy bf16, EOS ignored), offline LLM.generate.

    python3 ../shared/bench/workloads.py sharegpt-like --out .bench/w7.jsonl
    python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl [--max-num-seqs N ...] [--save]
With no size flags the engine chooses its batch sizes for the device (config.DeviceDefaults); the JSON names
the sizes it ran with. Prints JSON: output and total tok/s, preemptions, the settings, the device, and for
llama-3-8b on an H100 or H200 "roofline" (w7_floor.py's replay of this set at the run's settings and pool) and
"roofline_fraction" (out tok/s over the roofline's).

With DFLASH2_STEP_TRACE set, "trace_window_ms" is the timed run's span in the trace's t_ms (warm-up excluded):
    benchmarks/step_trace_report.py steps.jsonl --window-from w7.json
--profile-steps N runs the timed run's steps K..K+N-1 (K: --profile-after-steps) under torch.profiler (CUDA
kernels; host operators too with --profile-cpu; host operators only without CUDA) and adds "profile": the
window's top kernels, wall and kernel busy time. Such a run is marked "profiled": its tok/s is not a result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_name, finish, sync  # noqa: E402
from benchmarks.kernel_times import exposed_table, kernel_events  # noqa: E402
from benchmarks.w7_floor import device_floor  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402

TOP_KERNELS = 25


class StepProfiler:
    """Runs the engine's steps `after_steps` .. `after_steps + num_steps - 1`, counted from here, under
    torch.profiler, and tallies their plans; engine.step is the engine's own again once they have run."""

    def __init__(self, engine: Any, after_steps: int, num_steps: int, cpu: bool) -> None:
        import torch
        from torch.profiler import ProfilerActivity

        self.engine, self.after_steps, self.num_steps = engine, after_steps, num_steps
        self.cuda = torch.cuda.is_available()
        self.activities = [ProfilerActivity.CUDA] if self.cuda else []
        if cpu or not self.cuda:
            self.activities.append(ProfilerActivity.CPU)
        self.steps_run = self.profiled_steps = 0
        self.shapes = {"plans": 0, "decode_rows": 0, "prefill_tokens": 0}
        self.prof = self.started = self.wall_seconds = None
        self.trace_ms: list[float] = []
        self.step_fn, self.plan_fn = engine.step, engine.scheduler.plan
        engine.step = self.step

    def step(self) -> list:
        if self.steps_run == self.after_steps:
            self._start()
        outputs = self.step_fn()
        self.steps_run += 1
        if self.prof is not None:
            self.profiled_steps += 1
            if self.profiled_steps == self.num_steps:
                self.stop()
        return outputs

    def plan(self) -> Any:
        plan = self.plan_fn()
        self.shapes["plans"] += bool(plan)
        for chunk in plan.chunks:
            self.shapes["decode_rows" if chunk.is_decode else "prefill_tokens"] += chunk.num_tokens
        return plan

    def _start(self) -> None:
        from torch.profiler import profile

        self.prof = profile(activities=self.activities)
        self.prof.start()
        self.engine.scheduler.plan = self.plan
        self.trace_ms.append(trace_ms(self.engine))
        self.started = time.perf_counter()

    def stop(self) -> None:
        """End the window (the device drained first); a no-op outside one. Also called after the run, in case
        it ended inside the window."""
        if self.prof is None or self.wall_seconds is not None:
            return
        sync()
        self.wall_seconds = time.perf_counter() - self.started
        self.trace_ms.append(trace_ms(self.engine))
        self.prof.stop()
        self.engine.step, self.engine.scheduler.plan = self.step_fn, self.plan_fn

    def summary(self) -> dict[str, Any]:
        if self.prof is None:
            return {"error": f"the timed run had {self.steps_run} steps: none after the first {self.after_steps}"}
        wall_ms = self.wall_seconds * 1e3
        entry = {"activities": [str(a).split(".")[-1] for a in self.activities], "after_steps": self.after_steps,
                 "steps": self.profiled_steps, **self.shapes, "wall_ms": round(wall_ms, 2)}
        if None not in self.trace_ms:
            entry["trace_window_ms"] = self.trace_ms
        if self.cuda:
            totals, busy_us = device_kernels(self.prof)
            entry.update({"kernel_ms_sum": round(sum(us for _, us in totals.values()) / 1e3, 2),
                          "kernel_busy_ms": round(busy_us / 1e3, 2), "busy_of_wall": round(busy_us / 1e3 / wall_ms, 3),
                          "top": ranked(totals)})
        if len(self.activities) > 1 or not self.cuda:  # host operators: by self time (CPU-only: as "top")
            entry["top_host_ops" if self.cuda else "top"] = ranked(host_ops(self.prof))
        return entry


def trace_ms(engine: Any) -> float | None:
    """Now, in the step trace's t_ms (None without a trace)."""
    trace = engine.trace
    return None if trace is None else round((time.monotonic() - trace.started) * 1e3, 3)


def device_kernels(prof: Any) -> tuple[dict[str, list[float]], float]:
    """Each device kernel's (calls, total us) in the window, and the time the device was busy with any (us)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    events = kernel_events(prof)
    for start, end, name in events:
        totals[name][0] += 1
        totals[name][1] += end - start
    return totals, exposed_table(events, 1)[1] if events else 0.0


def host_ops(prof: Any) -> dict[str, list[float]]:
    """Each host operator's (calls, self us): self time, as operators nest."""
    return {event.key: [event.count, event.self_cpu_time_total] for event in prof.key_averages()
            if event.self_cpu_time_total > 0}


def ranked(totals: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The TOP_KERNELS largest by total time, each with its share of all of them."""
    summed_us = sum(us for _, us in totals.values())
    largest = sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return [{"kernel": name[:90], "calls": int(calls), "total_ms": round(us / 1e3, 3),
             "share": round(us / summed_us, 4) if summed_us else None} for name, (calls, us) in largest]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", ".bench", "w7.jsonl"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--prefill-chunk-size", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--label", default="", help="a name for this run in the JSON")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of the timed run")
    parser.add_argument("--profile-after-steps", type=int, default=300, help="the timed run's steps before them")
    parser.add_argument("--profile-cpu", action="store_true", help="host operators too (CUDA: kernels only)")
    args = parser.parse_args()

    rows = [json.loads(line) for line in open(args.data)]
    if args.num_prompts:
        rows = rows[: args.num_prompts]
    sizes = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
             if getattr(args, name) is not None}
    started = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", enable_prefix_caching=not args.no_prefix_caching, **sizes)
    load_seconds = time.perf_counter() - started
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in rows]
    # warm-up: a slice of the set with few new tokens, so the kernels are compiled before the clock runs
    llm.generate(prompts[:64], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    sync()
    preempted_before = llm.engine.scheduler.num_preemptions
    profiler = (StepProfiler(llm.engine, args.profile_after_steps, args.profile_steps, args.profile_cpu)
                if args.profile_steps > 0 else None)
    trace_window = [trace_ms(llm.engine)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    trace_window.append(trace_ms(llm.engine))
    if profiler is not None:
        profiler.stop()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    chosen = llm.engine.scheduler.config
    result = {"workload": "w7", "engine": "dflash2", "model": args.model, "label": args.label,
              "requests": len(prompts), "prompt_tokens": prompt_tokens, "generated": generated,
              "seconds": round(seconds, 3), "out_tok_s": round(generated / seconds, 1),
              "total_tok_s": round((generated + prompt_tokens) / seconds, 1),
              "preemptions": llm.engine.scheduler.num_preemptions - preempted_before,
              "settings": {"max_num_seqs": chosen.max_num_seqs, "max_num_batched_tokens": chosen.max_num_batched_tokens,
                           "prefill_chunk_size": chosen.prefill_chunk_size, "given": sorted(sizes),
                           "prefix_caching": not args.no_prefix_caching},
              "kv_pages": llm.engine.pool.num_pages, "tokens_per_page": llm.engine.kv.tokens_per_page,
              "load_seconds": round(load_seconds, 1), "profiled": profiler is not None}
    if args.model == "llama-3-8b":  # the floor's weights and FLOPs are this model's
        requests = [(len(p["prompt_token_ids"]), r["max_tokens"]) for p, r in zip(prompts, rows)]
        floor = device_floor(device_name(), requests, chosen.max_num_seqs, chosen.max_num_batched_tokens,
                             result["kv_pages"] * result["tokens_per_page"])
        if floor is not None:
            result["roofline"] = floor
            result["roofline_fraction"] = round(result["out_tok_s"] / floor["out_tok_s"], 3)
    if llm.engine.trace is not None:
        result["trace_window_ms"] = trace_window
    if profiler is not None:
        result["profile"] = profiler.summary()
    llm.close()
    finish(result, None, args.save)


if __name__ == "__main__":
    main()
