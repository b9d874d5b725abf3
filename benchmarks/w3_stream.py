"""Where the time goes between the engine producing a first token and the client reading it (W3's HTTP side).

The real server (FastAPI, uvicorn, EngineThread, observer, SSE formatting) runs in a subprocess around a
paced fake engine: each step sleeps --step-ms (releasing the GIL, like a GPU step), then gives one token to
each of up to --max-running requests (the others wait), and records when it produced each request's first
token (time.monotonic). The client is `dflash2.bench`'s, in this process, with --concurrency streams open
(Poisson arrivals above the fake engine's capacity, so all streams stay busy). Both clocks are
CLOCK_MONOTONIC on Linux, so the gap "engine first token -> client read" is measured per request.

    .venv/bin/python benchmarks/w3_stream.py --output /tmp/stream.json     # GPU-like: 32 x 4 ms steps, 128 streams

Report: gap p50/p99/max; server-side TTFT (submit -> first token, the engine's view); client TTFT; CPU
seconds per output token of the server process and of this (client) process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import print_report  # noqa: E402


# -- the server side (subprocess) -------------------------------------------------------------------
class PacedEngine:
    """Enough of Engine for EngineThread, the observer and the handlers; no model."""

    def __init__(self, step_ms: float, max_running: int, first_tokens_path: str, busy_ms: float = 0.0) -> None:
        from types import SimpleNamespace

        from dflash2.engine.kv.page_pool import PagePool

        self.step_s = step_ms / 1000.0
        self.busy_s = min(busy_ms, step_ms) / 1000.0  # of each step, Python work holding the GIL (a GPU host)
        self.max_running = max_running
        self.first_tokens_path = first_tokens_path
        self.pool = PagePool(max_running, 1024)
        self.kv = SimpleNamespace(tokens_per_page=16, num_prefix_queries=0, num_prefix_hits=0, num_swapped_requests=0)
        self.scheduler = SimpleNamespace(running={}, waiting=[], num_preemptions=0, num_swap_outs=0, swapped_bytes=0)
        self.model = SimpleNamespace(name="paced", device=SimpleNamespace(type="cpu"),
                                     arch=SimpleNamespace(vocab_size=1 << 16))
        self.max_model_len = 1 << 20
        self.tokenizer = None
        self.last_plan_seconds = 0.0
        self.first_token_at: dict[int, float] = {}  # the prompt's first token id -> when its first token came

    def add_request(self, prompt: dict, params: Any, priority: int, request_id: str) -> Any:
        from dflash2.request import Request

        request = Request(request_id, prompt["prompt_token_ids"], params, priority=priority)
        self.scheduler.waiting.append(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.running.pop(request_id, None)
        self.scheduler.waiting = [r for r in self.scheduler.waiting if r.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> list:
        from dflash2.request import CompletionOutput, RequestOutput, RequestStatus

        running, waiting = self.scheduler.running, self.scheduler.waiting
        waiting.sort(key=lambda r: -r.priority)
        while waiting and len(running) < self.max_running:
            request = waiting.pop(0)
            running[request.request_id] = request
        busy_until = time.perf_counter() + self.busy_s
        while time.perf_counter() < busy_until:  # plan + launch + commit: pure Python, the GIL held
            pass
        time.sleep(self.step_s - self.busy_s)
        now = time.monotonic()
        outputs = []
        for request in list(running.values()):
            request.token_ids.append(7)
            if request.num_output_tokens == 1:
                self.first_token_at[request.prompt_token_ids[0]] = now
            done = request.num_output_tokens >= request.sampling_params.max_tokens
            if done:
                request.status = RequestStatus.FINISHED_LENGTH
                del running[request.request_id]
            completion = CompletionOutput(0, "", request.output_token_ids, None, None, "length" if done else None)
            outputs.append(RequestOutput(request.request_id, None, request.prompt_token_ids, None, [completion],
                                         done, delta_text=" x", delta_token_ids=[7]))
        if not self.has_unfinished():
            with open(self.first_tokens_path, "w") as f:
                json.dump({"first_token_at": self.first_token_at, "cpu_s": time.process_time()}, f)
        return outputs


def serve_main(args: argparse.Namespace) -> int:
    from dflash2.server.config import ServerConfig
    from dflash2.server.launch import serve

    # one process: the paced engine's GIL-holding "host work" and the event loop share a GIL, as it measures
    config = ServerConfig(port=args.port, disable_log_requests=True, disable_log_stats=True, log_level="warning",
                          single_process=True)
    factory = lambda: PacedEngine(args.step_ms, args.max_running, args.first_tokens_path, args.busy_ms)  # noqa: E731
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    profile_path = os.environ.get("W3_STREAM_PROFILE")  # cProfile of the event loop thread, written at exit
    if not profile_path:
        return serve(config, factory)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(serve, config, factory)
    finally:
        profiler.dump_stats(profile_path)


# -- the client side --------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = 1000.0 * np.asarray(values)
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p99_ms": round(float(np.percentile(a, 99)), 2),
            "max_ms": round(float(a.max()), 2)}


def client_main(args: argparse.Namespace) -> int:
    from dflash2.bench.dataset import BenchItem
    from dflash2.bench.load import LoadConfig, run_async, run_load
    from dflash2.bench.server_process import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first_tokens_path = os.path.join(tempfile.mkdtemp(prefix="w3_stream_"), "first_tokens.json")
    command = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port), "--step-ms",
               str(args.step_ms), "--max-running", str(args.max_running), "--first-tokens-path", first_tokens_path,
               "--busy-ms", str(args.busy_ms), "--switch-interval-ms", str(args.switch_interval_ms)]
    server = subprocess.Popen(command)
    try:
        if not wait_healthy(url, 60.0, server):
            raise RuntimeError("the server did not become healthy")
        rng = random.Random(args.seed)
        items = [BenchItem([1000 + i, 5, 6, 7], args.output_len, rng.choice([0] * 7 + [100] * 2 + [1000]))
                 for i in range(args.num_prompts)]
        capacity = args.max_running / (args.output_len * args.step_ms / 1000.0)
        config = LoadConfig(url=url, concurrency=args.concurrency, request_rate=args.overload * capacity,
                            num_prompts=args.num_prompts, timeout_s=300.0, progress=False, seed=args.seed,
                            transport=args.transport)
        cpu_before = time.process_time()
        load = run_async(run_load(config, items))
        client_cpu_s = time.process_time() - cpu_before
        for _ in range(100):
            if os.path.exists(first_tokens_path):
                break
            time.sleep(0.1)
        with open(first_tokens_path) as f:
            server_record = json.load(f)
    finally:
        server.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly (and a profile gets written)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    first_token_at = {int(k): v for k, v in server_record["first_token_at"].items()}
    gaps, ttfts, urgent_gaps = [], [], []
    for item, result in zip(items, load.results):
        if not result.ok or result.ttft_s is None:
            continue
        gap = result.started_at + result.ttft_s - first_token_at[item.prompt[0]]
        gaps.append(gap)
        ttfts.append(result.ttft_s)
        if item.priority == 1000:
            urgent_gaps.append(gap)
    num_tokens = sum(r.output_tokens for r in load.results if r.ok)
    report = {
        "what": "engine first token -> client read, real server around a paced fake engine",
        "step_ms": args.step_ms, "busy_ms": args.busy_ms, "switch_interval_ms": args.switch_interval_ms,
        "max_running": args.max_running, "concurrency": args.concurrency,
        "requests": len(load.results), "completed": sum(r.ok for r in load.results),
        "errors": sorted({str(r.error)[:120] for r in load.results if not r.ok})[:5],
        "output_tokens_per_s": round(num_tokens / load.duration_s, 1),
        "gap_engine_to_client": percentiles(gaps), "gap_priority_1000": percentiles(urgent_gaps),
        "client_ttft": percentiles(ttfts),
        "server_cpu_us_per_token": round(1e6 * server_record["cpu_s"] / max(1, num_tokens), 1),
        "client_cpu_us_per_token": round(1e6 * client_cpu_s / max(1, num_tokens), 1),
        "transport": args.transport,
    }
    print_report(report, args.output)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=4.0)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--busy-ms", type=float, default=0.0,
                   help="of each step, this much pure-Python work holding the GIL (the GPU engine's host side)")
    p.add_argument("--switch-interval-ms", type=float, default=0.0, help="the server's sys.setswitchinterval")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--overload", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", default="auto", choices=["auto", "raw", "httpx"], help="the bench client's")
    p.add_argument("--output", default=None)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--first-tokens-path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    return serve_main(args) if args.serve else client_main(args)


if __name__ == "__main__":
    sys.exit(main())
