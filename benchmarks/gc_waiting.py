"""What a waiting line costs the server's garbage collector: the gc-tracked objects one waiting request adds,
and the collections' pauses (dflash2_gc_pause_seconds) while a long line drains (JSON out).

    .venv/bin/python benchmarks/gc_waiting.py --waiting 400,1600
    .venv/bin/python benchmarks/gc_waiting.py --waiting 400,1600 --gc-threshold 700,10,10   # CPython's default

The server runs in this process (uvicorn on a thread, the engine thread as in `dflash2 serve`) on a tiny random
Llama, so that gc.get_objects() sees its objects; the requests come from `dflash2 bench` subprocesses, whose
objects are not counted. The engine is held at first (its steps do nothing), so every request sits in the
scheduler's waiting line with its HTTP handler awaiting a first token, as in W3's overload. Then it serves them,
while as many requests again arrive at once (the line turns over, as under W3's overload), and the pauses of
the collections meanwhile are read from /metrics as W3 reads them.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from benchmarks.w3_server import gc_stats, scrape, step_stats  # noqa: E402
from dflash2.bench.server_process import free_port, wait_healthy  # noqa: E402
from dflash2.server.config import ServerConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waiting", default="400,1600", help="waiting-line lengths to count objects at (ascending)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gc-threshold", default=None, help="gc.set_threshold() once the server is up (default: the "
                                                        "server's own)")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


class HeldEngine:
    """Builds the engine; its steps do nothing (requests only queue) until release()."""

    def __init__(self, model_dir: str, max_num_seqs: int) -> None:
        self.model_dir, self.max_num_seqs = model_dir, max_num_seqs
        self.released = threading.Event()
        self.engine: Any = None

    def __call__(self) -> Any:
        from dflash2 import LLM

        self.engine = LLM(self.model_dir, device="cpu", max_num_seqs=self.max_num_seqs, max_model_len=512).engine
        step = self.engine.step

        def held_step() -> list:
            if self.released.is_set():
                return step()
            time.sleep(0.001)
            return []

        self.engine.step = held_step
        return self.engine

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)


def start_server(held: HeldEngine) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    from dflash2.server.app import build_app
    from dflash2.server.launch import build_state

    config = ServerConfig(port=free_port(), disable_log_requests=True, disable_log_stats=True, log_level="warning",
                          max_queue_len=None)  # the long waiting line is the point here
    app = build_app(build_state(config, held))
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           backlog=4096))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://{config.host}:{config.port}"
    if not wait_healthy(url, 300.0):
        raise RuntimeError("the server did not become healthy")
    return url, server, thread


def send(url: str, dataset: str, num_requests: int, max_tokens: int) -> subprocess.Popen:
    """`dflash2 bench` with every request in flight at once, in a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "dflash2.cli.main", "bench", "--url", url, "--endpoint",
                             "/generate", "--dataset", dataset, "--concurrency", str(num_requests), "--num-prompts",
                             str(num_requests), "--max-tokens", str(max_tokens), "--ignore-eos", "--no-progress",
                             "--timeout", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tracked_objects() -> collections.Counter:
    """gc-tracked objects outside the frozen (startup) generation by type name, garbage collected first."""
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def write_dataset(path: str, prompt_len: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(64):
            ids = [3 + (i * 7 + j) % 250 for j in range(prompt_len)]
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": max_tokens}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.tiny_models import build_tiny_model

    # 1. The server in this process, its engine held.
    work = tempfile.mkdtemp(prefix="dflash2-gc-")
    build_tiny_model("llama", os.path.join(work, "model"))
    dataset = os.path.join(work, "prompts.jsonl")
    write_dataset(dataset, args.prompt_len, args.max_tokens)
    held = HeldEngine(os.path.join(work, "model"), args.max_num_seqs)
    url, server, thread = start_server(held)
    if args.gc_threshold:
        gc.set_threshold(*(int(n) for n in args.gc_threshold.split(",")))
    time.sleep(1.0)

    # 2. Objects at each length of the waiting line.
    counts = [(0, tracked_objects())]
    clients = []
    for level in (int(n) for n in args.waiting.split(",")):
        clients.append(send(url, dataset, level - counts[-1][0], args.max_tokens))
        wait_for(lambda: held.num_waiting() >= level, 300.0, f"{level} waiting requests")
        time.sleep(2.0)  # the last handlers reach their await
        counts.append((level, tracked_objects()))
    (n0, c0), (n1, c1) = counts[0], counts[-1]

    # 3. Serve the line while as many requests again arrive; the collections meanwhile.
    before, started = scrape(url), time.monotonic()
    held.released.set()
    clients.append(send(url, dataset, n1, args.max_tokens))
    failed_clients = sum(client.wait(600) != 0 for client in clients)
    served_s = time.monotonic() - started
    after = scrape(url)
    cyclic_garbage = gc.collect()  # what the requests served left for the collector (reference cycles)
    server.should_exit = True  # its lifespan stops the engine thread
    thread.join(60)

    report = {"gc_threshold": list(gc.get_threshold()), "frozen_objects": gc.get_freeze_count(),
              "tracked_objects": {str(n): c.total() for n, c in counts},
              "objects_per_waiting_request": round((c1.total() - c0.total()) / (n1 - n0), 1),
              "by_type": {name: round(count / (n1 - n0), 1) for name, count in (c1 - c0).most_common(12)},
              "serve": {"requests": 2 * n1, "failed_clients": failed_clients, "seconds": round(served_s, 1),
                        "engine_steps": step_stats(before, after), "gc_pauses": gc_stats(before, after),
                        "cyclic_garbage_left": cyclic_garbage}}
    print_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
