"""W5: three models co-hosted in one `dflash2 serve` (one KV page pool, one priority scheduler) against three
servers, one per model, with the memory split statically between them, under the same bursty load (JSON out).

    setup "shared":  one server, --models-config (all three), the whole memory
    setup "static":  three servers, one model each, a third of the memory each (what people run today)

The load is replayed identically on both setups, one setup after the other: Poisson arrivals at --rate
requests/s for --duration-s, in phases of --phase-s during which one model (the hot one, cycling through the
three) receives --hot-share of the requests and the other two split the rest; priorities 0 / 100 / 1000 in
proportions 70 / 20 / 10; prompts of random token ids (--prompt-len +-50%), --max-tokens new tokens each, EOS
ignored. A static server holds only its third of the pool when its model is hot; the shared pool lends the hot
model the pages the cold ones leave unused.

Requests go to /generate (streamed, `model` and `priority` in the body): a dummy preset has no tokenizer, and
/v1/completions holds every token back until the end for want of text, so its first chunk comes with the last
token and no TTFT can be read from it; /generate streams each token's id.

GPU (W5 as specified: llama-3-8b int4, qwen3-0.6b bf16, llama-3.2-1b int8, dummy weights; ~8 minutes with the
six server starts):
    python3 benchmarks/multi_model.py --output w5.json
CPU end-to-end check (three dummy smollm2-135m, tiny pool, about a minute on 2 cores):
    .venv/bin/python benchmarks/multi_model.py --cpu-smoke

The GPU load's defaults (12 requests/s, prompts of 512-1536 tokens, 1024 new tokens) are meant to let the 8B
model's open requests outgrow a third of the memory in its hot phases while the whole pool still holds them. Each
setup's `peak_in_flight` per model and its servers' pool lines (`pool_log`) tell whether they did: without
preemptions in the static setup, raise --rate or give --kv-cache-memory; with seconds of TTFT in both, the GPU is
over capacity: lower --rate.

Report per setup and model: TTFT p50/p99 (ms), output tok/s, preemptions (/metrics), errors; totals; the ratios
static / shared of the p99 TTFT and shared / static of the total throughput; and the target: shared p99 TTFT at
least 2x lower than static, total throughput equal or higher (within THROUGHPUT_TOLERANCE), zero errors.
Exit status 0: target met or not judged (one setup), 2: missed, 1: a setup failed (its error in the JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from benchmarks.w3_server import cuda_available, percentile_ms  # noqa: E402
from dflash2.bench.client import RequestResult, send_raw  # noqa: E402
from dflash2.bench.dataset import BenchItem  # noqa: E402
from dflash2.bench.load import run_async  # noqa: E402
from dflash2.bench.server_process import ServerProcess  # noqa: E402
from dflash2.units import parse_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENDPOINT = "/generate"
PREEMPTIONS = "dflash2_num_preemptions_total"
CLASSES = (0, 100, 1000)
PROPORTIONS = (70, 20, 10)
TARGET_TTFT_RATIO = 2.0
# Both setups serve the same offered load, so their throughputs differ only by how fast they drain its tail:
# within this fraction they count as equal.
THROUGHPUT_TOLERANCE = 0.02
# Random prompt token ids stay below every preset's vocabulary (smollm2's 49,152 is the smallest).
TOKEN_ID_RANGE = (1000, 30000)

GPU_MODELS = [
    {"name": "llama-3-8b-int4", "path": "llama-3-8b", "load_format": "dummy", "quantization": "int4"},
    {"name": "qwen3-0.6b-bf16", "path": "qwen3-0.6b", "load_format": "dummy", "dtype": "bfloat16"},
    {"name": "llama-3.2-1b-int8", "path": "llama-3.2-1b", "load_format": "dummy", "quantization": "int8"},
]
CPU_SMOKE_MODELS = [{"name": f"smollm-{tag}", "path": "smollm2-135m", "load_format": "dummy"} for tag in "abc"]
# --cpu-smoke's defaults (flags given explicitly still win): each static server gets 8 pages of 22 tokens,
# about two requests, so the static half meets page shortage within seconds.
CPU_SMOKE_DEFAULTS = {"device": "cpu", "kv_cache_memory": "24MiB", "duration_s": 20.0, "phase_s": 5.0, "rate": 1.5,
                      "prompt_len": 48, "max_tokens": 16, "warmup_requests": 2}
# The engine options a single-model server takes as flags; an entry with any other option (quantization) is
# served alone from a one-entry --models-config instead.
ENTRY_FLAGS = {"load_format": "--load-format", "dtype": "--dtype", "kv_cache_dtype": "--kv-cache-dtype",
               "max_num_seqs": "--max-num-seqs", "tokenizer": "--tokenizer"}
POOL_SHARE_KEYS = ("min_pool_share", "max_pool_share")  # meaningless for a model alone on its pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="three dummy smollm2-135m on the CPU, tiny settings")
    p.add_argument("--models-config", default=None, help="the models (the server's --models-config format); "
                                                         "default: W5's three, or --cpu-smoke's")
    p.add_argument("--setup", choices=["both", "shared", "static"], default="both")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the shared server's; each static server gets a third")
    p.add_argument("--kv-cache-memory", default=None,
                   help="the shared pool's size instead (e.g. 24MiB); each static server gets a third")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the load's longest request (1.5 x --prompt-len + --max-tokens)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of every server (default on the CPU: cores - 1, a core left to the client)")
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for every server (repeat)")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--phase-s", type=float, default=5.0, help="seconds before the hot model changes")
    p.add_argument("--rate", type=float, default=12.0, help="requests per second, all models together")
    p.add_argument("--hot-share", type=float, default=0.8, help="the hot model's share of a phase's requests")
    p.add_argument("--prompt-len", type=int, default=1024, help="mean prompt tokens (+-50%%)")
    p.add_argument("--max-tokens", type=int, default=1024, help="new tokens per request")
    p.add_argument("--warmup-requests", type=int, default=4, help="per model, before measuring")
    p.add_argument("--request-timeout-s", type=float, default=180.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="servers' logs and config files (default: a temporary one)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        p.set_defaults(**CPU_SMOKE_DEFAULTS)
        args = p.parse_args(argv)
    return args


def load_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.models_config is None:
        return CPU_SMOKE_MODELS if args.cpu_smoke else GPU_MODELS
    with open(args.models_config) as f:
        document = json.load(f)
    return document["models"] if isinstance(document, dict) else document


# -- the load ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    at_s: float  # after the replay starts
    model: str
    item: BenchItem


def bursty_arrivals(names: list[str], args: argparse.Namespace) -> list[Arrival]:
    """Poisson arrivals at args.rate; within phase k the hot model is names[k % len(names)] and takes
    args.hot_share of them, the others split the rest evenly. Seeded: both setups replay the same list."""
    rng = random.Random(args.seed)
    arrivals, at_s = [], rng.expovariate(args.rate)
    while at_s < args.duration_s:
        hot = names[int(at_s // args.phase_s) % len(names)]
        cold = [name for name in names if name != hot]
        model = hot if not cold or rng.random() < args.hot_share else rng.choice(cold)
        arrivals.append(Arrival(at_s, model, random_item(rng, args.prompt_len, args.max_tokens)))
        at_s += rng.expovariate(args.rate)
    return arrivals


def random_item(rng: random.Random, prompt_len: int, max_tokens: int) -> BenchItem:
    length = rng.randint(max(1, prompt_len // 2), max(1, prompt_len * 3 // 2))
    priority = rng.choices(CLASSES, weights=PROPORTIONS)[0]
    return BenchItem([rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)], max_tokens, priority)


async def replay(arrivals: list[Arrival], urls: dict[str, str], timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send each arrival at its time (open loop: a slow server does not slow the arrivals); the results in
    arrival order and the seconds from the start to the last response."""
    started = time.perf_counter()

    async def one(arrival: Arrival) -> RequestResult:
        await asyncio.sleep(max(0.0, started + arrival.at_s - time.perf_counter()))
        sending = send_raw(urls[arrival.model], ENDPOINT, arrival.item, arrival.model, True, {})
        try:
            return await asyncio.wait_for(sending, timeout_s)
        except asyncio.TimeoutError:
            return RequestResult(arrival.item.priority, error=f"timed out after {timeout_s:g} s")

    results = await asyncio.gather(*(one(arrival) for arrival in arrivals))
    return list(results), time.perf_counter() - started


def warm_up(names: list[str], urls: dict[str, str], args: argparse.Namespace) -> None:
    """A few requests per model, all at once, prompts over the load's length range: first-use costs (kernel
    compilation for new shapes, allocator growth) land here, not in the measurement."""
    rng = random.Random(args.seed + 1)
    arrivals = [Arrival(0.0, name, random_item(rng, args.prompt_len, min(args.max_tokens, 8)))
                for name in names for _ in range(args.warmup_requests)]
    results, _ = run_async(replay(arrivals, urls, args.startup_timeout_s))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} warm-up requests failed, e.g. {failed[0]}")


# -- the servers -------------------------------------------------------------------------------------------
def common_flags(args: argparse.Namespace, device: str) -> list[str]:
    max_model_len = args.max_model_len or args.prompt_len * 3 // 2 + args.max_tokens
    flags = ["--device", device, "--max-model-len", str(max_model_len), "--disable-log-stats",
             "--disable-log-requests"]
    threads = args.num_threads or (max(1, (os.cpu_count() or 2) - 1) if device == "cpu" else None)
    if threads:
        flags += ["--num-threads", str(threads)]
    return flags + list(args.server_arg)


def memory_flags(args: argparse.Namespace, parts: int) -> list[str]:
    """The memory of one server of `parts` splitting the whole (1: the shared server)."""
    if args.kv_cache_memory is not None:
        return ["--kv-cache-memory", str(parse_bytes(args.kv_cache_memory) // parts)]
    return ["--gpu-memory-utilization", f"{args.gpu_memory_utilization / parts:.4g}"]


def write_models_config(entries: list[dict[str, Any]], path: Path) -> Path:
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return path


def alone_flags(entry: dict[str, Any], log_dir: Path) -> list[str]:
    """One model served alone: `--model PATH --served-model-name NAME` with its options as flags, or a
    one-entry --models-config when an option has no flag (quantized dummy weights), so that both setups load
    the same weights."""
    entry = {key: value for key, value in entry.items() if key not in POOL_SHARE_KEYS}
    if set(entry) - {"name", "path", *ENTRY_FLAGS}:
        return ["--models-config", str(write_models_config([entry], log_dir / f"{entry['name']}.json"))]
    flags = ["--model", entry["path"], "--served-model-name", entry["name"]]
    for key, flag in ENTRY_FLAGS.items():
        if key in entry:
            flags += [flag, str(entry[key])]
    return flags


def shared_servers(models: list[dict[str, Any]], args: argparse.Namespace, device: str,
                   log_dir: Path) -> dict[str, ServerProcess]:
    config = write_models_config(models, log_dir / "shared_models.json")
    server = ServerProcess("--models-config", str(config), *memory_flags(args, 1), *common_flags(args, device),
                           log_dir=str(log_dir / "shared"))
    return {entry["name"]: server for entry in models}


def static_servers(models: list[dict[str, Any]], args: argparse.Namespace, device: str,
                   log_dir: Path) -> dict[str, ServerProcess]:
    return {entry["name"]: ServerProcess(*alone_flags(entry, log_dir), *memory_flags(args, len(models)),
                                         *common_flags(args, device), log_dir=str(log_dir / f"static_{entry['name']}"))
            for entry in models}


def distinct(servers: dict[str, ServerProcess]) -> list[ServerProcess]:
    return list({id(server): server for server in servers.values()}.values())


def start_all(servers: list[ServerProcess], timeout_s: float) -> None:
    """Start every server at once (their loads and graph captures overlap) and wait until all are healthy."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(server.start, timeout_s) for server in servers]:
            future.result()


def preemptions_by_label(url: str) -> dict[str, float]:
    """dflash2_num_preemptions_total per model_name label ("" for a sample without one)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == PREEMPTIONS:
                label = sample.labels.get("model_name", "")
                counts[label] = counts.get(label, 0.0) + sample.value
    return counts


def preemptions_per_model(servers: dict[str, ServerProcess], before: dict[str, dict[str, float]],
                          after: dict[str, dict[str, float]]) -> dict[str, int | None]:
    """Each model's preemptions over the run: its own labelled sample where its server has several models,
    else all of its server's (None: a server of several without per-model samples)."""
    counts: dict[str, int | None] = {}
    for name, server in servers.items():
        delta = {label: value - before[server.url].get(label, 0.0) for label, value in after[server.url].items()}
        shared = sum(other is server for other in servers.values()) > 1
        counts[name] = int(delta[name]) if name in delta else (None if shared else int(sum(delta.values())))
    return counts


def pool_lines(server: ServerProcess) -> list[str]:
    """The server's log lines on its page pool (pages, tokens, GiB), timestamps cut off."""
    lines = server.stderr().splitlines()
    return [line.split(" INFO ", 1)[1] for line in lines if " INFO " in line and "pool" in line][:8]


# -- one setup -----------------------------------------------------------------------------------------------
def measure(setup: str, servers: dict[str, ServerProcess], arrivals: list[Arrival],
            args: argparse.Namespace) -> dict[str, Any]:
    """Start the setup's servers, warm them up, replay the load, read their preemption counters; always stop
    them."""
    names = list(servers)
    urls = {name: server.url for name, server in servers.items()}
    print(f"{setup}: starting {len(distinct(servers))} server(s)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        start_all(distinct(servers), args.startup_timeout_s)
        startup_s = time.perf_counter() - started
        warm_up(names, urls, args)
        before = {server.url: preemptions_by_label(server.url) for server in distinct(servers)}
        print(f"{setup}: replaying {len(arrivals)} requests over {args.duration_s:g} s", file=sys.stderr, flush=True)
        results, duration_s = run_async(replay(arrivals, urls, args.request_timeout_s))
        after = {server.url: preemptions_by_label(server.url) for server in distinct(servers)}
        logs = {server.stderr_path.parent.name: pool_lines(server) for server in distinct(servers)}
    finally:
        for server in distinct(servers):
            server.stop()
    report = setup_report(arrivals, results, duration_s, preemptions_per_model(servers, before, after))
    return {"commands": [" ".join(server.command) for server in distinct(servers)], "startup_s": round(startup_s, 1),
            "pool_log": logs, **report}


def measure_or_failure(setup: str, servers: dict[str, ServerProcess], arrivals: list[Arrival],
                       args: argparse.Namespace) -> dict[str, Any]:
    """measure(), or what went wrong: one setup failing (a server that does not start) still leaves the
    other's figures in the report."""
    try:
        return measure(setup, servers, arrivals, args)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, and the exit status says so
        return {"commands": [" ".join(server.command) for server in distinct(servers)],
                "failed": f"{type(e).__name__}: {e}"[-4000:]}


def setup_report(arrivals: list[Arrival], results: list[RequestResult], duration_s: float,
                 preemptions: dict[str, int | None]) -> dict[str, Any]:
    per_model = {}
    for name, count in preemptions.items():
        mine = [result for arrival, result in zip(arrivals, results) if arrival.model == name]
        per_model[name] = {**stats(mine, duration_s), "preemptions": count}
    known = [count for count in preemptions.values() if count is not None]
    total = {**stats(results, duration_s), "preemptions": sum(known) if len(known) == len(preemptions) else None,
             "ttft_p99_ms_by_priority": {str(c): percentile_ms(ttfts([r for r in results if r.priority == c]), 99)
                                         for c in CLASSES}}
    messages: dict[str, int] = {}
    for result in results:
        if not result.ok:
            messages[str(result.error)[:200]] = messages.get(str(result.error)[:200], 0) + 1
    return {"duration_s": round(duration_s, 2), "per_model": per_model, "total": total, "error_messages": messages}


def ttfts(results: list[RequestResult]) -> list[float]:
    return [r.ttft_s for r in results if r.ok and r.ttft_s is not None]


def stats(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    output_tokens = sum(r.output_tokens for r in results if r.ok)
    return {"requests": len(results), "errors": sum(not r.ok for r in results),
            "ttft_p50_ms": percentile_ms(ttfts(results), 50), "ttft_p99_ms": percentile_ms(ttfts(results), 99),
            "output_tokens": output_tokens, "output_tok_s": round(output_tokens / duration_s, 1),
            "peak_in_flight": peak_in_flight(results)}


def peak_in_flight(results: list[RequestResult]) -> int:
    """The most requests open at once (sent, not yet answered, queued ones included): with the load's lengths,
    how many pages the model would have needed to run them all, so whether the load pressed on its pool."""
    answered = [r for r in results if r.latency_s is not None]
    # at equal times an answer comes before a send: the count never includes a request already done
    events = sorted([(r.started_at, 1) for r in answered] + [(r.started_at + r.latency_s, -1) for r in answered])
    peak = open_now = 0
    for _, change in events:
        open_now += change
        peak = max(peak, open_now)
    return peak


# -- the verdict ---------------------------------------------------------------------------------------------
def compare(shared: dict[str, Any], static: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ratios static / shared of p99 TTFT (total and per model) and shared / static of total throughput,
    and the target on them."""
    ttft_ratio = ratio(static["total"]["ttft_p99_ms"], shared["total"]["ttft_p99_ms"])
    throughput_ratio = ratio(shared["total"]["output_tok_s"], static["total"]["output_tok_s"])
    comparison = {"p99_ttft_ratio_static_over_shared": ttft_ratio,
                  "p99_ttft_ratio_per_model": {name: ratio(static["per_model"][name]["ttft_p99_ms"],
                                                           model["ttft_p99_ms"])
                                               for name, model in shared["per_model"].items()},
                  "throughput_ratio_shared_over_static": throughput_ratio}
    target = {"p99_ttft_at_least_2x_lower": ttft_ratio is not None and ttft_ratio >= TARGET_TTFT_RATIO,
              "throughput_equal_or_higher": throughput_ratio is not None
              and throughput_ratio >= 1.0 - THROUGHPUT_TOLERANCE,
              "throughput_tolerance": THROUGHPUT_TOLERANCE,
              "zero_errors": shared["total"]["errors"] == 0 and static["total"]["errors"] == 0}
    target["met"] = target["p99_ttft_at_least_2x_lower"] and target["throughput_equal_or_higher"] \
        and target["zero_errors"]
    return comparison, target


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


# -- the run ---------------------------------------------------------------------------------------------------
def git_commit() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it (None where the tree is no git checkout)."""
    def git(*command: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(REPO), *command], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(changes) if commit else None}


def device_name(device: str) -> str:
    """Asked after the servers are gone: the first CUDA call would take this process a context's memory."""
    if device != "cuda":
        return f"cpu ({os.cpu_count()} cores)"
    import torch

    return torch.cuda.get_device_name(0)


def load_description(arrivals: list[Arrival], args: argparse.Namespace) -> dict[str, Any]:
    return {"duration_s": args.duration_s, "phase_s": args.phase_s, "rate_req_per_s": args.rate,
            "hot_share": args.hot_share, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "priorities": dict(zip(map(str, CLASSES), PROPORTIONS)), "seed": args.seed, "endpoint": ENDPOINT,
            "requests": len(arrivals),
            "requests_per_model": dict(Counter(arrival.model for arrival in arrivals))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if cuda_available() else "cpu")
    models = load_models(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dflash2-w5-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    arrivals = bursty_arrivals([entry["name"] for entry in models], args)
    setups = {"shared": shared_servers, "static": static_servers}
    measured = {setup: measure_or_failure(setup, build(models, args, device, log_dir), arrivals, args)
                for setup, build in setups.items() if args.setup in ("both", setup)}
    report: dict[str, Any] = {"workload": "W5", "date": time.strftime("%Y-%m-%d %H:%M"),
                              "device": device_name(device), **git_commit(),
                              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                              "log_dir": str(log_dir), "models": models, "load": load_description(arrivals, args),
                              "setups": measured}
    failed = any("failed" in setup for setup in measured.values())
    if len(measured) == 2 and not failed:
        report["comparison"], report["target"] = compare(measured["shared"], measured["static"])
    print_report(report, args.output)
    return 1 if failed else 2 if report.get("target", {}).get("met") is False else 0


if __name__ == "__main__":
    sys.exit(main())
