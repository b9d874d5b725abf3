"""Start-up time on the bundled model: `dflash2 generate` of 8 tokens end to end, and `dflash2 serve` until /health
answers 200, each with an empty tokenizer cache (the first start on a machine) and then with it filled. Prints JSON.

    .venv/bin/python benchmarks/startup.py [--repeats 2] [--output FILE]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from dflash2.bench.server_process import ServerProcess  # noqa: E402

GENERATE = [sys.executable, "-m", "dflash2.cli.main", "generate", "--prompt", "The capital of France is",
            "--max-tokens", "8", "--temperature", "0"]


def generate_seconds(env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(GENERATE, env=env, check=True, capture_output=True, timeout=600)
    return round(time.perf_counter() - started, 2)


def serve_ready_seconds(env: dict[str, str]) -> float:
    server = ServerProcess(env=env)
    started = time.perf_counter()
    try:
        server.start(timeout_s=600)
        return round(time.perf_counter() - started, 2)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="warm-cache runs of each (the cold one runs once)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    results: dict[str, object] = {"benchmark": "startup", "model": "bundled SmolLM2-135M-Instruct (Q4_1 GGUF)",
                                  "cpus": os.cpu_count()}
    for name, measure in (("generate_s", generate_seconds), ("serve_ready_s", serve_ready_seconds)):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "DFLASH2_CACHE_DIR": cache}
            cold = measure(env)
            results[name] = {"empty_tokenizer_cache": cold, "filled": [measure(env) for _ in range(args.repeats)]}
    print_report(results, args.output)


if __name__ == "__main__":
    main()
