"""C1 server: `dflash2 serve` on the bundled SmolLM2-135M on this CPU against the offline engine on the same
requests (issue 41). Prints JSON; --output keeps it.

    .venv/bin/python benchmarks/cpu_server.py [--dtype bfloat16 | --model DIR] [--num-threads N]
                                              [--output benchmarks/results/c1_server_cpu_fp32_DATE.json]

The load (issue 41's table): benchmarks/data/cpu_server.jsonl (32 prompts of 33-87 tokens), 128 new tokens each
(ignore_eos), greedy, streamed /v1/completions; 8 requests one at a time, then 32 requests 16 at a time, sent by
`dflash2 bench` as its own process. The server runs with its defaults (request log on, as a new user runs it).
The offline run takes the same prompts through LLM in this process, with the server's thread count: 8 `generate`
calls one after another, then the 32 requests 16 in flight (a new one added as each finishes). tok/s is output
tokens over the wall time of the whole phase (prefill included) on both sides. Both stay loaded and take turns
(served 1, offline 1, served 16, offline 16) for --rounds rounds: the 2-core machine's speed drifts by 10-20%
over minutes, and in turns it moves both sides alike. The medians are reported, every round beside them.

Each phase also records the CPU time that processes other than ours (server, client, this script) used meanwhile
(`other_cpu_share`, of all cores): above 0.05 the machine was busy and the phase is flagged `disturbed`.

Peers run on the same load when their virtual environments exist (never installed by this script):
    python3 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install 'llama-cpp-python[server]'
    python3 -m venv .venv-vllm && (vLLM's CPU build, docs.vllm.ai "CPU" installation) in .venv-vllm
llama.cpp's server serves the same GGUF with --n_threads set to our thread count; vLLM serves it with the float32
dtype and --vllm-tokenizer (a Hugging Face tokenizer directory: vLLM does not read a GGUF's own).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import print_report  # noqa: E402
from benchmarks.proc_cpu import tree_cpu_s  # noqa: E402
from dflash2.bench.server_process import ServerProcess  # noqa: E402

DATASET = ROOT / "benchmarks" / "data" / "cpu_server.jsonl"
NEW_TOKENS = 128
LOADS = ((1, 8), (16, 32))  # (requests in flight, requests)
DISTURBED_SHARE = 0.05
STARTUP_TIMEOUT_S = 600.0


# -- what else ran -----------------------------------------------------------------------------------------
def _machine_busy_s() -> float:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _, _, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s(server_pid: int | None) -> float:
    """This script, its waited-for children (the bench client) and the server's processes."""
    own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for field in ("ru_utime", "ru_stime"))
    return own + (tree_cpu_s(server_pid) if server_pid is not None else 0.0)


class OtherCpu:
    """CPU time used by other processes of the machine between start() and share()."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid

    def start(self) -> OtherCpu:
        self._at = (time.perf_counter(), _machine_busy_s(), _own_cpu_s(self.server_pid))
        return self

    def share(self) -> float:
        wall, busy, own = time.perf_counter(), _machine_busy_s(), _own_cpu_s(self.server_pid)
        other = (busy - self._at[1]) - (own - self._at[2])
        return round(max(0.0, other) / ((wall - self._at[0]) * (os.cpu_count() or 1)), 3)


# -- served ------------------------------------------------------------------------------------------------
def bench(url: str, concurrency: int, num_prompts: int, server_pid: int | None) -> dict[str, Any]:
    """One `dflash2 bench` run; the fields this benchmark reports."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        output = f.name
    meter = OtherCpu(server_pid).start()
    subprocess.run([sys.executable, "-m", "dflash2.cli.main", "bench", "--url", url, "--dataset", str(DATASET),
                    "--concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--max-tokens",
                    str(NEW_TOKENS), "--ignore-eos", "--no-progress", "--timeout", "600", "--output", output],
                   check=True, stdout=subprocess.DEVNULL)
    other = meter.share()
    report = json.loads(Path(output).read_text())
    os.unlink(output)
    return {"tok_s": round(report["output_throughput"], 1), "ttft_p50_ms": _round(report["ttft_p50"]),
            "ttft_p99_ms": _round(report["ttft_p99"]), "completed": report["completed"],
            "failed": report["failed"], "output_tokens": report["total_output_tokens"],
            "prompt_tokens": report["total_input_tokens"], "seconds": round(report["duration"], 2),
            "other_cpu_share": other, "disturbed": other > DISTURBED_SHARE}


def run_loads(server: ServerProcess) -> dict[str, Any]:
    """The loads once against a running server (a peer's)."""
    bench(server.url, 1, 1, None)  # warm-up (the first request's one-time costs)
    pid = server.process.pid if server.process is not None else None
    return {str(concurrency): bench(server.url, concurrency, count, pid) for concurrency, count in LOADS}


# -- offline -----------------------------------------------------------------------------------------------
class Offline:
    """The same requests through LLM in this process, with the server's thread count."""

    def __init__(self, args: argparse.Namespace, threads: int) -> None:
        from dflash2 import LLM, SamplingParams
        from dflash2.cpu_threads import use_engine_threads

        self.threads = use_engine_threads(threads)
        self.prompts = [json.loads(line)["prompt"] for line in DATASET.read_text().splitlines() if line.strip()]
        self.llm = LLM(args.model, dtype=args.dtype)
        self.params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        self.llm.generate(self.prompts[0], SamplingParams(max_tokens=4))  # warm-up

    def describe(self) -> dict[str, Any]:
        quant = self.llm.engine.model.quant
        weights = "float" if quant is None else {g: quant.bits_for(g) for g in ("embed", "qkv", "o_proj", "ffn",
                                                                                "lm_head")}
        return {"engine_threads": self.threads, "dtype": str(self.llm.engine.model.dtype), "weights": weights}

    def run(self, concurrency: int, count: int, server_pid: int | None) -> dict[str, Any]:
        prompts = [self.prompts[i % len(self.prompts)] for i in range(count)]
        meter = OtherCpu(server_pid).start()
        if concurrency == 1:
            started = time.perf_counter()
            outputs = [self.llm.generate(prompt, self.params)[0] for prompt in prompts]
            seconds, ttft_p50 = time.perf_counter() - started, None
        else:
            outputs, seconds, ttft_p50 = _closed_loop(self.llm.engine, prompts, self.params, concurrency)
        return _offline_phase(outputs, seconds, ttft_p50, meter.share())


def _closed_loop(engine: Any, prompts: list[str], params: Any, in_flight: int) -> tuple[list, float, float]:
    """`prompts` through the engine with `in_flight` at a time, a new one added as each finishes, as the bench
    client keeps its requests in flight: (the final outputs, seconds, TTFT p50 in ms)."""
    pending = iter(prompts)
    added: dict[str, float] = {}
    ttfts: list[float] = []
    started = time.perf_counter()

    def add() -> None:
        prompt = next(pending, None)
        if prompt is not None:
            added[engine.add_request(prompt, params).request_id] = time.perf_counter()

    for _ in range(in_flight):
        add()
    finished = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id in added and output.outputs[0].token_ids:
                ttfts.append(time.perf_counter() - added.pop(output.request_id))
            if output.finished:
                finished.append(output)
                add()
    ttfts.sort()
    return finished, time.perf_counter() - started, ttfts[len(ttfts) // 2] * 1000.0


def _offline_phase(outputs: list, seconds: float, ttft_p50_ms: float | None, other: float) -> dict[str, Any]:
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {"tok_s": round(tokens / seconds, 1), "ttft_p50_ms": _round(ttft_p50_ms), "output_tokens": tokens,
            "prompt_tokens": sum(len(output.prompt_token_ids) for output in outputs), "seconds": round(seconds, 2),
            "other_cpu_share": other, "disturbed": other > DISTURBED_SHARE}


# -- peers -------------------------------------------------------------------------------------------------
class _PeerServer(ServerProcess):
    """A peer's OpenAI server: ready once /v1/models answers (llama.cpp's has no /health)."""

    def start(self, timeout_s: float) -> _PeerServer:  # type: ignore[override]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=err, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.command[0]} did not start:\n{self.stderr_tail()}")


def peers(args: argparse.Namespace, gguf: str | None, threads: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    commands = {
        "llama.cpp": (args.llama_cpp_python, ["-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                                              "--n_threads", str(threads), "--n_ctx", "4096"], {}),
        "vllm": (args.vllm_python, ["-m", "vllm.entrypoints.openai.api_server", "--model", str(gguf), "--dtype",
                                    "float32", "--max-model-len", "4096",
                                    *(["--tokenizer", args.vllm_tokenizer] if args.vllm_tokenizer else [])],
                 {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads)}),
    }
    for name, (python, arguments, env) in commands.items():
        if gguf is None or not Path(python).exists():
            results[name] = "not installed" if gguf is not None else "no GGUF (a --model directory)"
            continue
        server = _PeerServer(command=[python, *arguments], env=env)  # (--port PORT goes last)
        try:
            results[name] = run_loads(server.start(STARTUP_TIMEOUT_S))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            results[name] = f"failed: {e}"
        finally:
            server.stop()
    return results


# -- the report --------------------------------------------------------------------------------------------
def _summary(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round's tok/s and TTFT, beside every round."""
    def median(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return round(statistics.median(known), 1) if known else None

    return {"tok_s": median([p["tok_s"] for p in phases]), "ttft_p50_ms": median([p["ttft_p50_ms"] for p in phases]),
            "rounds": phases}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU) or bfloat16")
    parser.add_argument("--num-threads", "--num_threads", type=int, default=None,
                        help="the engine's torch threads, served and offline (default: the server's own choice)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the loads, served and offline in turn (the medians are reported)")
    parser.add_argument("--no-offline", action="store_true", help="serve only")
    parser.add_argument("--llama-cpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-tokenizer", default=None, help="a Hugging Face tokenizer directory for vLLM")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # (stops the servers on the way out)

    from dflash2.cpu_threads import physical_cores_available
    from dflash2.loading.tokenizer import bundled_model_path

    flags = [*(["--model", args.model] if args.model else []), "--dtype", args.dtype,
             *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    result: dict[str, Any] = {
        "benchmark": "c1_cpu_server", "date": time.strftime("%Y-%m-%d"),
        "model": args.model or "bundled SmolLM2-135M-Instruct Q4_1 GGUF",
        "dtype_flag": args.dtype, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "physical_cores_available": physical_cores_available(), "load": {
            "dataset": str(DATASET.relative_to(ROOT)), "new_tokens": NEW_TOKENS, "greedy": True,
            "phases": [{"in_flight": c, "requests": n} for c, n in LOADS], "client": "dflash2 bench"},
        "server_command": "dflash2 serve " + " ".join(flags)}
    server = ServerProcess(*flags).start(STARTUP_TIMEOUT_S)
    try:
        threads = int(server.metric("dflash2_engine_torch_threads"))
        offline = None if args.no_offline else Offline(args, threads)
        bench(server.url, 1, 1, None)  # warm-up
        runs: dict[str, dict[str, list]] = {"served": {}, "offline": {}}
        for _ in range(args.rounds):  # served and offline in turn: a machine that drifts moves both alike
            for concurrency, count in LOADS:
                runs["served"].setdefault(str(concurrency), []).append(
                    bench(server.url, concurrency, count, server.process.pid))
                if offline is not None:
                    runs["offline"].setdefault(str(concurrency), []).append(
                        offline.run(concurrency, count, server.process.pid))
    finally:
        server.stop()
    result["served"] = {"engine_threads": threads, **{key: _summary(phases) for key, phases in runs["served"].items()}}
    if offline is not None:
        result["offline"] = {**offline.describe(), **{key: _summary(phases) for key, phases in runs["offline"].items()}}
        result["ratio"] = {key: round(result["served"][key]["tok_s"] / result["offline"][key]["tok_s"], 3)
                           for key in runs["served"]}
        offline.llm.close()
    gguf = args.model if args.model and args.model.endswith(".gguf") else (None if args.model else bundled_model_path())
    result["peers"] = peers(args, gguf, threads)
    result["disturbed"] = any(run["disturbed"] for side in runs.values() for phases in side.values() for run in phases)
    if result["disturbed"]:
        print("warning: other processes used the CPU during a phase (other_cpu_share); run again", file=sys.stderr)
    print_report(result, args.output)


if __name__ == "__main__":
    main()
