"""W3: priority under overload, through the real HTTP server (JSON out).

    1. start `dflash2 serve` (a subprocess) with a deliberately small page pool and host swap space;
    2. warm it up (every batch shape the load will use) with a closed loop that also measures its capacity
       (requests/s), then measure the idle TTFT of priority-1000 requests sent one at a time;
    3. offer load above capacity: Poisson arrivals at --overload (1.5) x that capacity, priorities 0/100/1000
       in proportions 70/20/10, with the `dflash2 bench` machinery, sampling the server's queue gauges;
    4. report per class p50/p99 TTFT and end-to-end latency, preemptions, swapped bytes, errors, completed,
       and the target: the 1000-class p99 TTFT under overload <= 2x its idle p99, zero errors, all completed,
       judged only when the idle phase is stable (idle p99 <= 2x idle p50: else a few disturbed idle
       requests would set the p99 the ratio divides by); the server-side ratio is reported beside it.

CPU, the bundled model and the shipped sample dataset through the chat endpoint (about 4 minutes on 2 cores):
    .venv/bin/python benchmarks/priority.py --output benchmarks/results/w3_cpu.json
GPU, dummy Qwen3-0.6B and a tokenizer-free dataset of token ids (see benchmarks/gpu_w3.sh):
    python3 benchmarks/priority.py --model qwen3-0.6b --load-format dummy --device cuda \\
        --synthetic 400 --prompt-len 256 --output-len 64 --kv-cache-memory 384MiB --swap-space 4 \\
        --max-num-seqs 32 --output w3_gpu.json

Why open-loop arrivals by default: a closed-loop client sends its next request right after the last token of
the previous one, which the server delivers at the end of a step, so that request lands just after the next
step started and waits for almost all of it. Where one step costs about as much as an idle TTFT (the CPU),
that synchronization alone doubles the urgent TTFT; independent (Poisson) arrivals land anywhere in a step.
The server's own view (queue time and TTFT per class from its JSON request log, and step times from
dflash2_step_duration_seconds) is in the report beside the client's.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from benchmarks.w3_server import (COUNTERS, GAUGES, SERVER_GC_METRIC, cuda_available, gc_stats,  # noqa: E402
                                  percentile_ms, request_log, scrape, server_side, step_stats, ttft_breakdown,
                                  w3_server)
from dflash2.bench.client import RequestResult  # noqa: E402
from dflash2.bench.dataset import BenchItem, load_dataset  # noqa: E402
from dflash2.bench.load import LoadConfig, run_async, run_load, run_per_priority  # noqa: E402

CLASSES = (0, 100, 1000)
PROPORTIONS = (70, 20, 10)
URGENT = 1000
TARGET_RATIO = 2.0
# One request at a time on an idle server has a tight TTFT: a p99 over this many times the median means a few
# requests met interference (a stall in the server, a hiccup in the client), and the ratio over such a p99
# would pass the target for the wrong reason: the target is then not judged met.
IDLE_SPREAD_LIMIT = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server (the engine flags W3 runs with)")
    server.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    server.add_argument("--load-format", default="auto")
    server.add_argument("--tokenizer", default=None)
    server.add_argument("--device", default="auto")
    server.add_argument("--dtype", default="auto")
    server.add_argument("--kv-cache-memory", default="12MiB", help="small, so that pages run out")
    server.add_argument("--swap-space", default="0.25", help="GiB of host memory for preempted KV")
    server.add_argument("--max-num-seqs", type=int, default=4)
    server.add_argument("--max-model-len", type=int, default=256)
    server.add_argument("--prefill-chunk-size", type=int, default=64)
    server.add_argument("--max-num-batched-tokens", type=int, default=128)
    server.add_argument("--preemption-threshold", type=int, default=1)
    server.add_argument("--max-outranked-prefill-tokens", type=int, default=None,
                        help="the server's cap on less urgent prefill chunks while an urgent request waits or "
                             "prefills (default: the server's, 64)")
    server.add_argument("--torch-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the server (default on the CPU: cores - 1, leaving a core to "
                             "the HTTP loop and this client)")
    server.add_argument("--server-arg", action="append", default=[], help="one more flag for the server (repeat)")
    server.add_argument("--url", default=None, help="use this running server instead of starting one")
    server.add_argument("--server-log-dir", default=None, help="keep the server's stdout/stderr here (default: a "
                                                               "temporary directory)")
    load = p.add_argument_group("load")
    load.add_argument("--dataset", default=None, help="jsonl as `dflash2 bench` takes it (default: the sample)")
    load.add_argument("--synthetic", type=int, default=0,
                      help="instead of a dataset: N prompts of random token ids (no tokenizer needed)")
    load.add_argument("--prompt-len", type=int, default=256, help="--synthetic: tokens per prompt (+-50%%)")
    load.add_argument("--output-len", type=int, default=64, help="--synthetic: new tokens per request")
    load.add_argument("--endpoint", default=None,
                      help="default: /v1/chat/completions for text prompts (the bundled model is an instruct "
                           "model: on a raw prompt its first token is mostly its end-of-turn token, which shows no "
                           "text, so a completion's first text is its second token), else /generate (token ids, "
                           "--synthetic)")
    load.add_argument("--idle-requests", type=int, default=20, help="sequential priority-1000 requests")
    load.add_argument("--idle-max-tokens", type=int, default=8,
                      help="new tokens per idle request (only their TTFT is compared)")
    load.add_argument("--warmup-requests", type=int, default=None,
                      help="closed loop at 2 x --max-num-seqs, which also measures capacity (default: 4 x "
                           "--max-num-seqs)")
    load.add_argument("--num-prompts", type=int, default=None,
                      help="overload requests, cycling the dataset (default: the dataset's length)")
    load.add_argument("--overload", type=float, default=1.5,
                      help="Poisson arrivals at this multiple of the capacity the warm-up measured")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals at this rate instead")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop instead: keep this many in flight (arrivals then follow step ends)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--transport", default="auto", choices=["auto", "raw", "httpx"],
                      help="the bench client's HTTP transport (auto: the lean asyncio reader for http://; httpx "
                           "costs ~3x the client CPU per token and adds its own queueing at GPU token rates)")
    load.add_argument("--client-processes", default="per-class", choices=["per-class", "one"],
                      help="Poisson overload: each priority class sends from its own client process, at its "
                           "share of the rate (per-class, as separate services would), or all from one process "
                           "(one: its event loop reads every bulk stream too, and its queueing adds to the "
                           "urgent TTFT it measures)")
    load.add_argument("--scrape-interval-s", type=float, default=1.0,
                      help="overload: seconds between /metrics scrapes, by this script (queue gauges) and the "
                           "least urgent client (GPU gauges); 0: none (a scrape makes the engine render its "
                           "metrics between two steps)")
    p.add_argument("--output", default=None, help="write the JSON report here (also printed)")
    return p.parse_args(argv)


# -- the server ------------------------------------------------------------------------------------
def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
             "--kv-cache-memory", args.kv_cache_memory, "--swap-space", str(args.swap_space),
             "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
             "--prefill-chunk-size", str(args.prefill_chunk_size),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--preemption-threshold", str(args.preemption_threshold),
             "--max-queue-len", "100000",  # overload piles up thousands waiting: measured, not refused
             "--disable-log-stats"]
    if args.max_outranked_prefill_tokens is not None:
        flags += ["--max-outranked-prefill-tokens", str(args.max_outranked_prefill_tokens)]
    if args.model:
        flags += ["--model", args.model]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    return flags + list(args.server_arg)


def server_threads(args: argparse.Namespace) -> int | None:
    """On the CPU the engine's torch threads share the cores with the HTTP loop and the load client; with one
    thread per core, a parallel region waits for whichever thread the OS took off its core, and steps
    slow down many times over. So the default leaves one core free."""
    if args.torch_threads is not None:
        return args.torch_threads
    if args.device == "cuda" or (args.device == "auto" and cuda_available()):
        return None
    return max(1, (os.cpu_count() or 2) - 1)


async def sample_gauges(url: str, peaks: dict[str, float], means: dict[str, list[float]],
                        interval_s: float = 1.0) -> None:
    """Every interval_s: the queue gauges' peaks and samples (until cancelled)."""
    while True:
        try:
            values = await asyncio.to_thread(scrape, url)
        except Exception:  # noqa: BLE001 - a missed sample is not a failure of the run
            values = {}
        for name in GAUGES:
            if name in values:
                peaks[name] = max(peaks.get(name, 0.0), values[name])
                means.setdefault(name, []).append(values[name])
        await asyncio.sleep(interval_s)


# -- the workload ----------------------------------------------------------------------------------
def synthetic_items(count: int, prompt_len: int, output_len: int, seed: int) -> list[BenchItem]:
    """Token-id prompts (no tokenizer needed), priorities exactly 70/20/10 in a seeded shuffle."""
    rng = random.Random(seed)
    priorities = [c for c, share in zip(CLASSES, PROPORTIONS) for _ in range(round(count * share / 100))]
    priorities = (priorities + [CLASSES[0]] * count)[:count]
    rng.shuffle(priorities)
    items = []
    for priority in priorities:
        length = rng.randint(max(1, prompt_len // 2), max(1, prompt_len * 3 // 2))
        items.append(BenchItem([rng.randrange(1000, 30000) for _ in range(length)], output_len, priority))
    return items


def class_stats(results: list[RequestResult]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    e2e = [r.latency_s for r in done if r.latency_s is not None]
    return {"requests": len(results), "completed": len(done), "failed": len(results) - len(done),
            "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
            "ttft_max_ms": percentile_ms(ttft, 100),
            "latency_p50_ms": percentile_ms(e2e, 50), "latency_p99_ms": percentile_ms(e2e, 99)}


async def overload(config: LoadConfig, items: list[BenchItem], per_class: bool,
                   scrape_interval_s: float = 1.0) -> tuple[Any, dict, dict]:
    peaks: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    sampler = (asyncio.create_task(sample_gauges(config.url, peaks, samples, scrape_interval_s))
               if scrape_interval_s > 0 else None)
    config = (replace(config, scrape_interval_s=scrape_interval_s) if scrape_interval_s > 0
              else replace(config, scrape_metrics=False))
    try:
        if per_class and config.request_rate != float("inf"):
            load = await asyncio.to_thread(run_per_priority, config, items)
        else:
            load = await run_load(config, items)
    finally:
        if sampler is not None:
            sampler.cancel()
    return load, peaks, {k: round(float(np.mean(v)), 3) for k, v in samples.items()}


@dataclass
class Phases:
    """What the three phases measured: raw results and /metrics snapshots at the phase boundaries."""

    capacity_req_per_s: float
    load_config: LoadConfig
    idle: Any = None
    load: Any = None
    snapshots: list[dict[str, float]] = field(default_factory=list)  # before idle, before load, after load
    marks: list[float] = field(default_factory=list)  # wall times of the same boundaries
    peaks: dict[str, float] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)


def run(args: argparse.Namespace, url: str) -> Phases:
    """1. warm-up that measures capacity; 2. idle urgent requests one at a time; 3. the overload."""
    items = (synthetic_items(args.synthetic, args.prompt_len, args.output_len, args.seed) if args.synthetic
             else load_dataset(args.dataset))
    text = all(isinstance(item.prompt, str) for item in items)
    endpoint = args.endpoint or ("/v1/chat/completions" if text else "/generate")
    num_prompts = args.num_prompts or len(items)
    base = LoadConfig(url=url, endpoint=endpoint, concurrency=2 * args.max_num_seqs, num_prompts=num_prompts,
                      timeout_s=args.timeout, ignore_eos=args.ignore_eos, seed=args.seed, progress=False,
                      transport=args.transport)
    urgent_items = [replace(item, priority=URGENT) for item in items if item.priority == URGENT] or \
        [replace(item, priority=URGENT) for item in items]

    # 1. Warm-up (every batch size and chunk shape the load will use), closed loop: it also measures capacity.
    warmup = args.warmup_requests if args.warmup_requests is not None else 4 * args.max_num_seqs
    print(f"warm-up: {warmup} requests, {base.concurrency} in flight", flush=True)
    probe = run_async(run_load(replace(base, num_prompts=max(1, warmup)), items))
    run_async(run_load(replace(base, concurrency=1, num_prompts=3), urgent_items))
    capacity = sum(r.ok for r in probe.results) / probe.duration_s
    if args.concurrency is not None and args.request_rate is None:
        load_config = replace(base, concurrency=args.concurrency)
    else:
        load_config = replace(base, concurrency=num_prompts,
                              request_rate=args.request_rate or args.overload * capacity)
    phases = Phases(capacity, load_config)

    # 2. Idle: urgent requests one at a time (only their TTFT is compared, so they are short).
    print(f"idle: {args.idle_requests} priority-{URGENT} requests one at a time", flush=True)
    idle_items = [replace(item, max_tokens=min(item.max_tokens, args.idle_max_tokens)) for item in urgent_items]
    phases.marks.append(time.time())
    phases.snapshots.append(scrape(url))
    # no /metrics scraping here: each scrape is work on the server's event loop that a lone urgent request
    # could queue behind, and the idle phase needs no gauges
    phases.idle = run_async(run_load(replace(base, concurrency=1, num_prompts=args.idle_requests,
                                             scrape_metrics=False), idle_items))
    phases.snapshots.append(scrape(url))
    phases.marks.append(time.time())

    # 3. Overload: the whole mix, arrivals above capacity.
    print(f"overload: {num_prompts} requests, {describe_arrivals(load_config, args.client_processes)}; capacity ~{capacity:.2f} req/s, "
          f"server max_num_seqs {args.max_num_seqs}", flush=True)
    phases.load, phases.peaks, phases.means = run_async(overload(load_config, items,
                                                                  args.client_processes == "per-class",
                                                                  args.scrape_interval_s))
    phases.snapshots.append(scrape(url))
    phases.marks.append(time.time())
    return phases


def describe_arrivals(config: LoadConfig, client_processes: str = "one") -> str:
    if config.request_rate != float("inf"):
        split = ", one client process per priority class" if client_processes == "per-class" else ""
        return f"Poisson at {config.request_rate:.2f} req/s{split}"
    return f"closed loop, {config.concurrency} in flight"


def build_report(args: argparse.Namespace, phases: Phases, server_log: str | None) -> dict[str, Any]:
    idle, load, config = phases.idle, phases.load, phases.load_config
    idle_stats = class_stats(idle.results)
    per_class = {str(c): class_stats([r for r in load.results if r.priority == c])
                 for c in sorted({r.priority for r in load.results})}
    failed = [r for r in load.results + idle.results if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        errors[str(r.error)[:200]] = errors.get(str(r.error)[:200], 0) + 1
    completed = sum(s["completed"] for s in per_class.values())
    start, before, after = phases.snapshots
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    sides = breakdowns = (None, None)
    if server_log:
        records = request_log(server_log)
        sides = (server_side(records, *phases.marks[0:2]), server_side(records, *phases.marks[1:3]))
        breakdowns = (ttft_breakdown(records, idle.results),
                      ttft_breakdown(records, [r for r in load.results if r.priority == URGENT]))
    target = verdict(per_class.get(str(URGENT), {}).get("ttft_p99_ms"), idle_stats["ttft_p50_ms"],
                     idle_stats["ttft_p99_ms"], len(failed), completed, len(load.results))
    return {
        "workload": "W3", "date": time.strftime("%Y-%m-%d"), "device": _device_name(args.device),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "server_flags": server_flags(args) if not args.url else None, "endpoint": config.endpoint,
        "server_torch_threads": server_threads(args) if not args.url else None,
        "idle": {**idle_stats, "priority": URGENT, "max_tokens": args.idle_max_tokens,
                 "engine_steps": step_stats(start, before),
                 "server_side": sides[0], "ttft_breakdown": breakdowns[0]},
        "overload": {
            "requests": len(load.results), "arrivals": describe_arrivals(config, args.client_processes),
            "capacity_req_per_s": round(phases.capacity_req_per_s, 3),
            "offered_req_per_s": round(config.request_rate, 3) if config.request_rate != float("inf") else None,
            "served_req_per_s": round(completed / load.duration_s, 3), "duration_s": round(load.duration_s, 2),
            "completed": completed, "errors": len(failed), "error_messages": errors,
            "output_tokens_per_s": round(sum(r.output_tokens for r in load.results if r.ok) / load.duration_s, 1),
            "per_class": per_class,
            "server_side": sides[1],
            "urgent_ttft_breakdown": breakdowns[1],
            "engine_steps": step_stats(before, after),
            "gc_pauses": gc_stats(before, after),  # the engine's process
            "gc_pauses_server": gc_stats(before, after, SERVER_GC_METRIC),  # the HTTP server's (none: one process)
            "preemptions": int(delta["dflash2_num_preemptions_total"]),
            "swap_outs": int(delta["dflash2_num_swap_outs_total"]),
            "swapped_bytes": int(delta["dflash2_swapped_bytes_total"]),
            "rejected_503": int(delta["dflash2_num_requests_rejected_total"]),
            "peak": {name.removeprefix("dflash2_"): value for name, value in phases.peaks.items()},
            "mean": {name.removeprefix("dflash2_"): value for name, value in phases.means.items()},
        },
        "target": {**target, "server_side_ratio": _server_side_ratio(*sides)},
    }


def verdict(urgent_p99: float | None, idle_p50: float | None, idle_p99: float | None, failed: int, completed: int,
            requested: int) -> dict[str, Any]:
    """The target: urgent p99 TTFT under overload <= TARGET_RATIO x the idle p99, zero errors, every request
    completed, judged only on a stable idle phase (its p99 at most IDLE_SPREAD_LIMIT x its median)."""
    ratio = urgent_p99 / idle_p99 if urgent_p99 and idle_p99 else None
    spread = idle_p99 / idle_p50 if idle_p50 and idle_p99 else None
    stable = spread is not None and spread <= IDLE_SPREAD_LIMIT
    met = ratio is not None and ratio <= TARGET_RATIO and stable and not failed and completed == requested
    return {"urgent_ttft_p99_ratio": round(ratio, 2) if ratio is not None else None, "max_ratio": TARGET_RATIO,
            "zero_errors": not failed, "all_completed": completed == requested,
            "idle_p99_over_p50": round(spread, 2) if spread is not None else None, "idle_stable": stable,
            "met": met}


def _server_side_ratio(idle: dict | None, load: dict | None) -> float | None:
    """The same ratio from the server's own TTFTs (its request log), for reading beside the client's."""
    idle_p99 = ((idle or {}).get(str(URGENT)) or {}).get("ttft_p99_ms")
    load_p99 = ((load or {}).get(str(URGENT)) or {}).get("ttft_p99_ms")
    return round(load_p99 / idle_p99, 2) if idle_p99 and load_p99 else None


def _device_name(device: str) -> str:
    try:
        import torch

        if device != "cpu" and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a name is only a label
        pass
    return f"cpu ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.url is None:
        server = w3_server(server_flags(args), server_threads(args), args.server_log_dir)
        print("starting:", " ".join(server.command), flush=True)
        server.start(timeout_s=900.0)
    try:
        phases = run(args, args.url or server.url)
        report = build_report(args, phases, str(server.stdout_path) if server else None)
    finally:
        if server is not None:
            server.stop()
    print_report(report, args.output)
    return 0 if report["target"]["met"] else 2


if __name__ == "__main__":
    sys.exit(main())
