"""W4: multi-turn conversations against a tiered KV cache, one fresh server per setting, the same workload each
(JSON out).

    setting "none":   no tiers (--swap-space 0): a page the device pool evicts is gone, its turn recomputes it
    setting "l2":     host memory below the device pool (--swap-space --l2-gib)
    setting "l2_l3":  a small host tier and a disk tier below it (--swap-space --l2-l3-host-gib, --enable-l3-cache
                      in --l3-dir, --l3-cache-size --l3-size)

The workload is `workloads.py multi-turn` (conversations that come back: a turn's prompt is the whole history so
far plus a new user message). Its rows are sent in their order to the streamed /generate (prompt token ids, EOS
ignored, greedy) with at most --concurrency in flight (12: the in-flight conversations fit the 8 GiB pool; at 32 it
thrashes, and swaps evict the host tier); a row waits for its conversation's previous turn to end
(and the rows behind it wait with it, so every setting sees the same order). The device pool (--kv-cache-memory)
holds a fraction of the conversations, so without tiers a conversation's history is mostly evicted by the time it
comes back.

GPU (W4 as specified: llama-3-8b dummy weights, bf16, an 8 GiB device pool, 64 conversations x 6 turns):
    python3 benchmarks/multi_turn.py --output w4.json    (workloads.py from .bench/ there: it is git-ignored)
CPU end-to-end check (dummy smollm2-135m, 6 conversations x 3 turns cut to short prompts, a tiny pool; about
half a minute per setting on 2 cores):
    .venv/bin/python benchmarks/multi_turn.py --cpu-smoke --settings none,l2

Report per setting: TTFT p50/p99 (ms) of the later turns (turn >= 1) and of the first turns, e2e p50, output and
total ((prompt + output) tokens / wall time) throughput, errors, prompt tokens sent / served from the cache
(usage.prompt_tokens_details.cached_tokens) / recomputed, and the prefix cache's counters over the run (/metrics,
per tier where the server has them: null where not). Against "none": the later turns' TTFT p50 ratio none /
setting, the total throughput ratio setting / none, and whether any later turn was slower than the same turn in
"none". Target (l2 and l2_l3): ratio >= 5, throughput ratio >= 2, no later turn slower.
Exit status 0: target met or not judged, 2: missed, 1: a setting failed (its error in the JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report
from benchmarks.multi_model import common_flags, device_name, git_commit, pool_lines, ratio, warm_up
from benchmarks.w3_server import cuda_available, percentile_ms
from dflash2.bench.client import RequestResult, send_raw
from dflash2.bench.dataset import BenchItem
from dflash2.bench.load import run_async
from dflash2.bench.server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
WORKLOADS_PY = ("../shared/bench/workloads.py", ".bench/workloads.py")  # relative to the repository, first found
ENDPOINT = "/generate"
SETTINGS = ("none", "l2", "l2_l3")
COUNTERS = {"dflash2_prefix_cache_queries_total": "queries", "dflash2_prefix_cache_hits_total": "hits",
            "dflash2_num_preemptions_total": "preemptions", "dflash2_cache_evictions_total": "evictions"}
TIER_HITS = "dflash2_kv_cache_tier_hit_tokens_total"  # labelled tier="device" | "host" | "disk"
TIERS = ("device", "host", "disk")
TIER_BYTES = {"dflash2_kv_tier_bytes_written_total": "written", "dflash2_kv_tier_bytes_read_total": "read"}
L3_READ_US = "dflash2_l3_cache_avg_latency_us"
TARGET_TTFT_RATIO = 5.0
TARGET_THROUGHPUT_RATIO = 2.0
GPU_DEFAULTS = {"model": "llama-3-8b", "load_format": "dummy", "dtype": "bfloat16", "kv_cache_memory": "8GiB"}
# Pages of 1 MiB hold 22 tokens of smollm2-135m in fp32: 48 MiB is ~1,050 tokens, just over the longest
# request's max_model_len (1024), while the 6 conversations reach ~4,900 tokens together.
CPU_SMOKE_DEFAULTS = {"device": "cpu", "model": "smollm2-135m", "load_format": "dummy", "dtype": "auto",
                      "kv_cache_memory": "48MiB", "conversations": 6, "turns": 3, "max_prompt_tokens": 128,
                      "max_output_tokens": 16, "concurrency": 4, "l2_gib": 0.5, "l2_l3_host_gib": 0.02,
                      "l3_size": "1GiB", "warmup_requests": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="dummy smollm2-135m on the CPU, a small workload")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which to run, comma-separated, in this order")
    p.add_argument("--workloads-py", default=None, help=f"workloads.py (default: the first of {WORKLOADS_PY})")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="cut each conversation's first tokens (the system prompt) so its first turn has at most "
                        "this many; later turns lose the same tokens, so they still extend the earlier ones")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap every row's max_tokens")
    p.add_argument("--concurrency", type=int, default=12, help="requests in flight at most")
    p.add_argument("--model", default=GPU_DEFAULTS["model"])
    p.add_argument("--load-format", default=GPU_DEFAULTS["load_format"])
    p.add_argument("--dtype", default=GPU_DEFAULTS["dtype"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--kv-cache-memory", default=GPU_DEFAULTS["kv_cache_memory"], help="the device pool")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest request (prompt + max_tokens) rounded up to a power of 2")
    p.add_argument("--l2-gib", type=float, default=32.0, help="host tier of the l2 setting (--swap-space)")
    p.add_argument("--l2-l3-host-gib", type=float, default=4.0, help="host tier of the l2_l3 setting")
    p.add_argument("--l3-dir", default=None, help="the disk tier's folder (default: a temporary one, removed after)")
    p.add_argument("--l3-size", default="64GiB", help="the disk tier's size (--l3-cache-size)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the server (default on the CPU: cores - 1, a core left to the client)")
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for every server (repeat)")
    p.add_argument("--warmup-requests", type=int, default=4, help="random prompts before measuring")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="servers' logs and per-request records (default: temporary)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        p.set_defaults(**CPU_SMOKE_DEFAULTS)
        args = p.parse_args(argv)
    args.settings = [setting.strip() for setting in args.settings.split(",") if setting.strip()]
    unknown = sorted(set(args.settings) - set(SETTINGS))
    if unknown or not args.settings:
        p.error(f"--settings takes some of {', '.join(SETTINGS)}; got {unknown or 'none'}")
    return args


# -- the workload ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    item: BenchItem


def workloads_path(path: str | None) -> Path:
    """workloads.py: --workloads-py, else the first of WORKLOADS_PY that exists."""
    candidates = [Path(path)] if path else [REPO / name for name in WORKLOADS_PY]
    found = next((candidate for candidate in candidates if candidate.is_file()), None)
    if found is None:
        raise FileNotFoundError(f"no workloads.py at {', '.join(map(str, candidates))}")
    return found.resolve()


def workloads_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("workloads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_turns(args: argparse.Namespace) -> list[Turn]:
    """W4's rows in arrival order, each conversation's prefix cut by --max-prompt-tokens and outputs capped by
    --max-output-tokens."""
    rows = workloads_module(workloads_path(args.workloads_py)).multi_turn(args.conversations, args.turns, args.seed)
    cut = {row["conversation"]: max(0, len(row["prompt_token_ids"]) - (args.max_prompt_tokens or 0))
           for row in rows if row["turn"] == 0} if args.max_prompt_tokens else {}
    turns = []
    for row in rows:
        prompt = row["prompt_token_ids"][cut.get(row["conversation"], 0):]
        max_tokens = min(row["max_tokens"], args.max_output_tokens or row["max_tokens"])
        turns.append(Turn(row["conversation"], row["turn"], BenchItem(prompt, max_tokens)))
    return turns


def longest_request(turns: list[Turn]) -> int:
    return max(len(turn.item.prompt) + turn.item.max_tokens for turn in turns)


def load_description(turns: list[Turn], args: argparse.Namespace) -> dict[str, Any]:
    prompts = [len(turn.item.prompt) for turn in turns]
    last_turns = {turn.conversation: turn for turn in turns}  # the history each conversation reaches
    return {"workload": "multi_turn", "workloads_py": str(workloads_path(args.workloads_py)),
            "conversations": args.conversations, "turns": args.turns, "seed": args.seed,
            "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens,
            "requests": len(turns), "prompt_tokens": sum(prompts),
            "mean_prompt_tokens": round(statistics.mean(prompts)),
            "longest_request_tokens": longest_request(turns),
            "conversation_tokens_total": sum(len(t.item.prompt) + t.item.max_tokens for t in last_turns.values()),
            "concurrency": args.concurrency, "endpoint": ENDPOINT, "ignore_eos": True, "temperature": 0.0,
            "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
            "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len}


# -- the replay ----------------------------------------------------------------------------------------------
async def replay(turns: list[Turn], url: str, concurrency: int,
                 timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send the turns in order, at most `concurrency` at once, each after its conversation's previous turn has
    ended; the results in the turns' order and the seconds from the first send to the last answer."""
    slots = asyncio.Semaphore(concurrency)
    latest: dict[int, asyncio.Task] = {}  # each conversation's turn sent last

    async def one(turn: Turn) -> RequestResult:
        try:
            return await asyncio.wait_for(send_raw(url, ENDPOINT, turn.item, None, True, {}), timeout_s)
        except TimeoutError:
            return RequestResult(0, error=f"timed out after {timeout_s:g} s")
        finally:
            slots.release()

    started = time.perf_counter()
    tasks = []
    for turn in turns:
        if turn.conversation in latest:
            await latest[turn.conversation]
        await slots.acquire()
        latest[turn.conversation] = asyncio.create_task(one(turn))
        tasks.append(latest[turn.conversation])
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


def scrape_counters(url: str) -> dict[str, float]:
    """COUNTERS, the tier hits ("tier_device", ...), the bytes each way per tier ("written_disk", ...) and the disk
    tier's mean read time from /metrics, summed over labels; absent ones left out."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            tier = sample.labels.get("tier")
            key = (f"tier_{tier}" if sample.name == TIER_HITS else f"{TIER_BYTES[sample.name]}_{tier}"
                   if sample.name in TIER_BYTES else "l3_read_us" if sample.name == L3_READ_US
                   else COUNTERS.get(sample.name))
            if key is not None:
                values[key] = values.get(key, 0.0) + sample.value
    return values


# -- one setting ---------------------------------------------------------------------------------------------
def tier_flags(setting: str, args: argparse.Namespace, l3_dir: str | None) -> list[str]:
    if setting == "none":
        return ["--swap-space", "0"]
    if setting == "l2":
        return ["--swap-space", f"{args.l2_gib:g}"]
    return ["--swap-space", f"{args.l2_l3_host_gib:g}", "--enable-l3-cache", "--l3-cache-path", str(l3_dir),
            "--l3-cache-size", args.l3_size]


def setting_server(setting: str, args: argparse.Namespace, device: str, log_dir: Path,
                   l3_dir: str | None) -> ServerProcess:
    model_flags = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
                   "--kv-cache-memory", args.kv_cache_memory]
    return ServerProcess(*model_flags, *tier_flags(setting, args, l3_dir), *common_flags(args, device),
                         log_dir=str(log_dir / setting))


def measure(setting: str, server: ServerProcess, turns: list[Turn],
            args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult]]:
    """Start the server, warm it up, replay the turns between two scrapes of its counters; always stop it."""
    print(f"{setting}: starting the server", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        server.start(args.startup_timeout_s)
        startup_s = time.perf_counter() - started
        warm_up([None], {None: server.url}, warmup_args(turns, args))
        before = scrape_counters(server.url)
        print(f"{setting}: replaying {len(turns)} turns", file=sys.stderr, flush=True)
        results, wall_s = run_async(replay(turns, server.url, args.concurrency, args.request_timeout_s))
        after = scrape_counters(server.url)
    finally:
        server.stop()
    report = {"server_command": " ".join(server.command), "startup_s": round(startup_s, 1),
              **setting_report(turns, results, wall_s), "prefix_cache": cache_report(before, after),
              "pool_log": pool_lines(server), "requests_log": str(write_records(turns, results, server.log_dir))}
    return report, results


def warmup_args(turns: list[Turn], args: argparse.Namespace) -> argparse.Namespace:
    """multi_model.warm_up's knobs: random prompts around the first turns' median length, a few tokens each."""
    first = [len(turn.item.prompt) for turn in turns if turn.turn == 0]
    return argparse.Namespace(seed=args.seed, prompt_len=int(statistics.median(first)), max_tokens=8,
                              warmup_requests=args.warmup_requests, startup_timeout_s=args.startup_timeout_s)


def measure_or_error(setting: str, turns: list[Turn], args: argparse.Namespace, device: str,
                     log_dir: Path) -> tuple[dict[str, Any], list[RequestResult] | None]:
    """measure() on a fresh server, or {"error": ...} (a server that refuses its flags, a failed warm-up): the
    other settings still run. A temporary L3 folder is removed afterwards."""
    l3_dir = None
    if setting == "l2_l3":
        l3_dir = args.l3_dir or tempfile.mkdtemp(prefix="dflash2-w4-l3-", dir="/tmp")
    server = setting_server(setting, args, device, log_dir, l3_dir)
    try:
        return measure(setting, server, turns, args)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, and the exit status says so
        return {"server_command": " ".join(server.command), "error": f"{type(e).__name__}: {e}"[-4000:]}, None
    finally:
        if l3_dir is not None and args.l3_dir is None:
            shutil.rmtree(l3_dir, ignore_errors=True)


def write_records(turns: list[Turn], results: list[RequestResult], folder: Path) -> Path:
    """One JSON line per request: conversation, turn, prompt tokens, TTFT, e2e, output and cached tokens."""
    path = folder / "requests.jsonl"
    with path.open("w") as f:
        for turn, result in zip(turns, results, strict=True):
            f.write(json.dumps({"conversation": turn.conversation, "turn": turn.turn,
                                "prompt_tokens": len(turn.item.prompt), "ttft_ms": milliseconds(result.ttft_s),
                                "e2e_ms": milliseconds(result.latency_s), "output_tokens": result.output_tokens,
                                "cached_tokens": result.cached_tokens, "error": result.error}) + "\n")
    return path


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


# -- the figures ---------------------------------------------------------------------------------------------
def setting_report(turns: list[Turn], results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Latencies and throughput of the requests done; prompt tokens sent (all requests), served from the cache
    (the final events' cached_tokens; None: the server sends none) and recomputed (the rest)."""
    done = [(turn, result) for turn, result in zip(turns, results, strict=True) if result.ok]
    output_tokens = sum(result.output_tokens for _, result in done)
    sent = sum(len(turn.item.prompt) for turn in turns)
    known = [result.cached_tokens for _, result in done if result.cached_tokens is not None]
    cached = sum(known) if known else None
    messages = Counter(str(result.error)[:200] for result in results if not result.ok)
    return {"wall_s": round(wall_s, 2), "requests_done": len(done), "errors": len(results) - len(done),
            "error_messages": dict(messages),
            "ttft_later_turns_ms": ttft_percentiles([r for t, r in done if t.turn >= 1]),
            "ttft_first_turns_ms": ttft_percentiles([r for t, r in done if t.turn == 0]),
            "e2e_p50_ms": percentile_ms([r.latency_s for _, r in done], 50),
            "output_tokens": output_tokens, "output_tok_s": round(output_tokens / wall_s, 1),
            "total_tok_s": round((sum(len(t.item.prompt) for t, _ in done) + output_tokens) / wall_s, 1),
            "prompt_tokens_sent": sent, "prompt_tokens_cached": cached,
            "prompt_tokens_recomputed": None if cached is None else sent - cached}


def ttft_percentiles(results: list[RequestResult]) -> dict[str, float | None]:
    ttfts = [result.ttft_s for result in results if result.ttft_s is not None]
    return {"p50": percentile_ms(ttfts, 50), "p99": percentile_ms(ttfts, 99), "count": len(ttfts)}


def cache_report(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The counters' deltas over the run (None: the server has no such counter) and the hit ratios of all tiers
    together and of each tier: hit tokens / prompt tokens looked up."""
    delta = {key: after[key] - before.get(key, 0.0) if key in after else None
             for key in [*COUNTERS.values(), *(f"tier_{tier}" for tier in TIERS)]}
    queries = delta["queries"]

    def share(hits: float | None) -> float | None:
        return round(hits / queries, 4) if hits is not None and queries else None

    return {**{key: delta[key] for key in COUNTERS.values()}, "hit_ratio": share(delta["hits"]),
            "tier_hit_tokens": {tier: delta[f"tier_{tier}"] for tier in TIERS},
            "tier_hit_ratio": {tier: share(delta[f"tier_{tier}"]) for tier in TIERS},
            "tier_bytes": {kind: {tier: after[f"{kind}_{tier}"] - before.get(f"{kind}_{tier}", 0.0)
                                  for tier in TIERS if f"{kind}_{tier}" in after} for kind in TIER_BYTES.values()},
            "l3_avg_read_us": after.get("l3_read_us")}


def compare(setting: str, report: dict[str, Any], results: list[RequestResult], none_report: dict[str, Any],
            none_results: list[RequestResult], turns: list[Turn]) -> dict[str, Any]:
    """The setting against "none": TTFT p50 of the later turns (none / setting), total throughput (setting /
    none), and each later turn's TTFT against the same turn's in "none" (a failed turn counts as slower)."""
    ttft_ratio = ratio(none_report["ttft_later_turns_ms"]["p50"], report["ttft_later_turns_ms"]["p50"])
    throughput_ratio = ratio(report["total_tok_s"], none_report["total_tok_s"])
    pairs = [(result.ttft_s, peer.ttft_s) for turn, result, peer in zip(turns, results, none_results, strict=True)
             if turn.turn >= 1 and peer.ttft_s is not None]
    slower = [(mine, theirs) for mine, theirs in pairs if mine is None or mine > theirs]
    worst = max((mine / theirs for mine, theirs in pairs if mine is not None and theirs > 0), default=None)
    comparison = {"ttft_p50_later_turns_ratio_none_over_setting": ttft_ratio,
                  "total_throughput_ratio_setting_over_none": throughput_ratio,
                  "later_turns_compared": len(pairs), "later_turns_slower": len(slower),
                  "worst_later_turn_ttft_ratio_setting_over_none": None if worst is None else round(worst, 2),
                  "no_later_turn_slower": bool(pairs) and not slower}
    if setting in ("l2", "l2_l3"):
        comparison["target_met"] = (ttft_ratio is not None and ttft_ratio >= TARGET_TTFT_RATIO
                                    and throughput_ratio is not None and throughput_ratio >= TARGET_THROUGHPUT_RATIO
                                    and comparison["no_later_turn_slower"])
    return comparison


# -- the run ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if cuda_available() else "cpu")
    turns = build_turns(args)
    longest = longest_request(turns)
    args.max_model_len = args.max_model_len or 1 << (longest - 1).bit_length()
    if args.max_model_len < longest:
        raise SystemExit(f"--max-model-len {args.max_model_len} is below the longest request ({longest} tokens)")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dflash2-w4-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    measured = {setting: measure_or_error(setting, turns, args, device, log_dir) for setting in args.settings}
    report: dict[str, Any] = {"workload": "W4", "date": time.strftime("%Y-%m-%d %H:%M"),
                              "device": device_name(device), **git_commit(),
                              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                              "log_dir": str(log_dir), "load": load_description(turns, args),
                              "settings": {setting: figures for setting, (figures, _) in measured.items()}}
    none_report, none_results = measured.get("none", ({}, None))
    if none_results is not None:
        report["comparison"] = {setting: compare(setting, figures, results, none_report, none_results, turns)
                                for setting, (figures, results) in measured.items()
                                if setting != "none" and results is not None}
    print_report(report, args.output)
    failed = any(results is None for _, results in measured.values())
    missed = any(c.get("target_met") is False for c in report.get("comparison", {}).values())
    return 1 if failed else 2 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
