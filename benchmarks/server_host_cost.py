"""The server path's host cost per token (issue 44, item 2): `dflash2 serve` as a subprocess, `dflash2 bench` against
it, and the CPU seconds each server process spent over the run (benchmarks/proc_cpu.py), per output token.

    .venv/bin/python benchmarks/server_host_cost.py                              # the bundled model on this CPU
    python3 benchmarks/server_host_cost.py --serve "--model llama-3-8b --load-format dummy" \\
        --dataset .bench/w7.jsonl --num-prompts 1000 --concurrency 1000 --ignore-eos            (GPU: W7)

The HTTP process (FastAPI, request parsing, detokenized text, the reply) and the engine process (scheduler, model
runner, sampling) are separate, so the HTTP side's time is the server path's own cost: it runs beside the engine's
steps, not in them. Prints JSON: per endpoint, output tokens, wall seconds, tok/s, and each process's CPU
milliseconds per output token (the engine's includes the model's own compute on a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from benchmarks.proc_cpu import children, own_cpu_s, tree_cpu_s  # noqa: E402
from dflash2.bench.server_process import ServerProcess  # noqa: E402


def cpu_seconds(pid: int) -> dict[str, float]:
    """The HTTP process's own CPU seconds and those of the processes below it (the engine)."""
    return {"http": own_cpu_s(pid), "engine": sum(tree_cpu_s(child) for child in children(pid))}


def bench(url: str, endpoint: str, args: argparse.Namespace, num_prompts: int, output: str | None) -> None:
    command = [sys.executable, "-m", "dflash2.cli.main", "bench", "--url", url, "--endpoint", endpoint,
               "--num-prompts", str(num_prompts), "--concurrency", str(args.concurrency), "--no-progress"]
    command += ["--dataset", args.dataset] if args.dataset else []
    command += ["--ignore-eos"] if args.ignore_eos else []
    command += ["--max-tokens", str(args.max_tokens)] if args.max_tokens else []
    command += ["--output", output] if output else []
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", default="", help="dflash2 serve flags (default: the bundled model)")
    parser.add_argument("--endpoints", default="/generate,/v1/completions")
    parser.add_argument("--dataset", default=None, help="dflash2 bench --dataset (default: its shipped sample)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    server = ServerProcess("--disable-log-requests", *shlex.split(args.serve)).start(600)
    report = {"serve": args.serve, "concurrency": args.concurrency, "num_prompts": args.num_prompts, "runs": []}
    try:
        pid = server.process.pid
        for endpoint in args.endpoints.split(","):
            bench(server.url, endpoint, args, min(8, args.num_prompts), None)  # warm-up
            with tempfile.TemporaryDirectory() as tmp:
                before, started = cpu_seconds(pid), time.perf_counter()
                bench(server.url, endpoint, args, args.num_prompts, os.path.join(tmp, "bench.json"))
                wall, after = time.perf_counter() - started, cpu_seconds(pid)
                with open(os.path.join(tmp, "bench.json")) as f:
                    result = json.load(f)
            tokens = result["total_output_tokens"]
            report["runs"].append({
                "endpoint": endpoint, "completed": result["completed"], "failed": result["failed"],
                "output_tokens": tokens, "wall_s": round(wall, 2), "out_tok_s": round(result["output_throughput"], 1),
                **{f"{side}_cpu_ms_per_token": round((after[side] - before[side]) * 1e3 / max(tokens, 1), 3)
                   for side in ("http", "engine")}})
    finally:
        server.stop()
    print_report(report, args.output)


if __name__ == "__main__":
    main()
