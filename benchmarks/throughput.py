"""W1 throughput: qwen3-0.6b (dummy bf16), the requests of w1_throughput.jsonl, 512 new tokens each, EOS ignored.

    python3 benchmarks/throughput.py --data .bench/w1_throughput.jsonl [--peer-json peer_w1.json] [--save]
Prints JSON: output tok/s, the roofline ceiling for this workload and the fraction of it reached, and the
fraction of wall time the GPU was busy over a window of steady decode, twice: CUDA events around each step
(`gpu_busy_events`, no profiler) and the torch profiler's kernel intervals (`gpu_busy`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import finish, sync  # noqa: E402
from benchmarks.kernel_times import exposed_table, kernel_events  # noqa: E402
from benchmarks.roofline import decode_ceiling_tok_s  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402
from dflash2.engine.step_trace import StepTrace  # noqa: E402


@contextlib.contextmanager
def steady_decode(llm: LLM, prompts: list, params: SamplingParams, warm_steps: int):
    """The engine with these requests added and `warm_steps` steps run (prefill done: steady decode); runs
    them to the end on exit."""
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    for _ in range(warm_steps):
        engine.step()
    sync()
    try:
        yield engine
    finally:
        while engine.has_unfinished():
            engine.step()


def timed_steps(engine, steps: int) -> float:
    """Wall seconds of `steps` engine steps, the device drained at the end."""
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return time.perf_counter() - started


def gpu_busy_events(llm: LLM, prompts: list, params: SamplingParams, warm_steps: int, steps: int) -> dict:
    """GPU busy over `steps` steps of steady decode without a profiler (CUPTI slows the host: on some hosts a
    profiled step took 12 ms against 8.4 unprofiled): the engine's step trace (engine/step_trace.py) times each
    step's device work with CUDA events around its launch (its kernels, copies and the sampled-token copy),
    from when the device reached it; busy = the sum of those times / wall. Gaps where the device waited for the
    host between steps are not counted; within an eager step they would be (W1's decode steps are graph
    replays)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "steps.jsonl")
        with steady_decode(llm, prompts, params, warm_steps) as engine:
            engine.trace = StepTrace(path, engine.model.device)
            wall = timed_steps(engine, steps)
        engine.trace.close()  # the run has drained: every traced step's line is written, in launch order
        engine.trace = None
        with open(path) as f:
            busy_ms = sum(json.loads(line)["device_ms"] for line in f.readlines()[:steps])
    return {"method": "cuda events around each step's launch", "steps": steps, "wall_ms": round(wall * 1e3, 2),
            "device_ms": round(busy_ms, 2), "busy_fraction_of_wall": round(busy_ms / 1e3 / wall, 3)}


def gpu_busy_fraction(llm: LLM, prompts: list, params: SamplingParams, warm_steps: int, steps: int) -> dict:
    """Run `steps` engine steps of steady decode under the torch profiler; busy = union of kernel time / wall."""
    from torch.profiler import ProfilerActivity, profile

    with steady_decode(llm, prompts, params, warm_steps) as engine:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # CUDA only: no per-op host tracing cost
            wall = timed_steps(engine, steps)
    events = kernel_events(prof)
    busy = exposed_table(events, 1)[1]  # us: the union of the kernels' intervals
    span = (max(end for _, end, _ in events) - events[0][0]) if events else 0.0
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70), flush=True)
    return {"profiled_steps": steps, "wall_ms": round(wall * 1e3, 2), "kernel_busy_ms": round(busy / 1e3, 2),
            "busy_fraction_of_wall": round(busy / 1e6 / wall, 3),
            "busy_fraction_of_kernel_span": round(busy / span, 3) if span else None}


def prefill_profile(llm: LLM, prompts: list, params: SamplingParams) -> str:
    """The torch profiler's top CUDA kernels over the first prefill steps of these prompts."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    print(table, flush=True)
    while engine.has_unfinished():
        engine.step()
    return "printed above"


class StepLog:
    """Wall time of each engine step, split by whether the step's plan had prefill tokens."""

    def __init__(self, llm: LLM) -> None:
        self.rows: list[tuple[float, int, int]] = []
        engine = llm.engine
        plan_fn, step_fn = engine.scheduler.plan, engine.step
        current = {}

        def plan():
            result = plan_fn()
            current["tokens"] = result.num_tokens
            current["decodes"] = sum(1 for c in result.chunks if c.num_tokens == 1 and c.start > 0)
            return result

        def step():
            start = time.perf_counter()
            out = step_fn()
            self.rows.append((time.perf_counter() - start, current.get("tokens", 0), current.get("decodes", 0),
                              engine.last_plan_seconds, engine.last_launch_seconds, engine.last_finish_seconds))
            return out

        engine.scheduler.plan, engine.step = plan, step

    def summary(self) -> dict:
        mixed = [r for r in self.rows if r[1] > r[2]]
        decode = [r for r in self.rows if r[1] == r[2] and r[1] > 0]
        return {"steps": len(self.rows),
                "prefill_steps": len(mixed), "prefill_seconds": round(sum(r[0] for r in mixed), 3),
                "prefill_tokens": sum(r[1] - r[2] for r in mixed),
                "decode_steps": len(decode), "decode_seconds": round(sum(r[0] for r in decode), 3),
                "decode_ms_first_last": [round(decode[0][0] * 1e3, 2), round(decode[-1][0] * 1e3, 2)] if decode else None,
                # host time of a decode step: Scheduler.plan(), building inputs + launching, waiting + committing
                "decode_host_ms_mean": {name: round(sum(r[i] for r in decode) / len(decode) * 1e3, 3)
                                        for i, name in ((3, "plan"), (4, "launch"), (5, "finish"))} if decode else None}


def decode_config(spec: str) -> tuple[str, dict[str, int]]:
    """--decode-config's "LABEL=BLOCK_N,num_warps,num_stages" (three positive integers)."""
    label, _, values = spec.partition("=")
    parts = values.split(",")
    if not label or len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected LABEL=BLOCK_N,num_warps,num_stages, e.g. float=32,2,2")
    return label, dict(zip(("BLOCK_N", "num_warps", "num_stages"), (int(p) for p in parts)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", ".bench", "w1_throughput.jsonl"))
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefill-chunk-size", type=int, default=4096)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16 here), bf16, fp16, fp8, int8, int4")
    parser.add_argument("--kv-layout", default="head_major", choices=["head_major", "token_major"])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also measure GPU busy time over steady decode")
    parser.add_argument("--profile-prefill", action="store_true", help="print the top kernels of prefill steps")
    parser.add_argument("--blas", default=None, help="torch.backends.cuda.preferred_blas_library: cublas or cublaslt")
    parser.add_argument("--warmup-tokens", type=int, default=32)
    parser.add_argument("--decode-config", action="append", default=[], type=decode_config,
                        help="LABEL=BLOCK_N,num_warps,num_stages for a DECODE_CONFIGS entry (repeat), e.g. "
                             "int8-imma_t=128,2,2 (the labels tune_decode.py prints; float for a 16-bit cache)")
    parser.add_argument("--peer-json", default=None)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()

    rows = [json.loads(line) for line in open(args.data)]
    if args.num_prompts:
        rows = rows[: args.num_prompts]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    new_tokens = rows[0]["max_tokens"]
    started = time.perf_counter()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    for label, config in args.decode_config:
        from dflash2.kernels.triton.attention import DECODE_CONFIGS

        DECODE_CONFIGS[label] = config
    llm = LLM(args.model, load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              prefill_chunk_size=args.prefill_chunk_size,
              kv_cache_dtype=args.kv_cache_dtype, kv_layout=args.kv_layout, enforce_eager=args.enforce_eager,
              overlap=False if args.no_overlap else None, enable_prefix_caching=False)
    load_seconds = time.perf_counter() - started
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
    # warm-up: the whole workload once with fewer new tokens, so every kernel variant is compiled
    llm.generate(prompts, SamplingParams(max_tokens=args.warmup_tokens, ignore_eos=True, temperature=0))
    sync()
    log = StepLog(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    arch, layout = llm.engine.model.arch, llm.engine.runner.layout
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    # KV bytes per element with the scales spread over it (int8: (128 + 2) / 128 for head_dim 128)
    kv_element_bytes = layout.bytes_per_token / (2 * arch.num_layers * arch.num_kv_heads * arch.head_dim)
    ceiling = decode_ceiling_tok_s(arch, prompt_lens, new_tokens, kv_element_bytes=kv_element_bytes)
    out_tok_s = generated / seconds
    result = {"workload": "w1", "engine": "dflash2", "model": args.model, "requests": len(prompts),
              "generated": generated, "seconds": round(seconds, 3), "out_tok_s": round(out_tok_s, 1),
              "kv_cache_dtype": layout.kv_dtype, "kv_layout": "head_major" if layout.head_major else "token_major",
              "kv_bytes_per_token": layout.bytes_per_token,
              "roofline_tok_s": round(ceiling, 1), "fraction_of_roofline": round(out_tok_s / ceiling, 3),
              "roofline_tok_s_bf16_kv": round(decode_ceiling_tok_s(arch, prompt_lens, new_tokens), 1),
              "load_seconds": round(load_seconds, 1), "preemptions": llm.engine.scheduler.num_preemptions,
              "kv_pages": llm.engine.pool.num_pages, "tokens_per_page": llm.engine.kv.tokens_per_page,
              "cuda_graphs": llm.engine.runner.graphs is not None, "overlap": llm.engine.overlap,
              "max_num_batched_tokens": args.max_num_batched_tokens, "prefill_chunk_size": args.prefill_chunk_size,
              "phases": log.summary()}
    if args.decode_config:
        result["decode_configs"] = dict(args.decode_config)
    if args.profile_prefill:
        result["prefill_profile"] = prefill_profile(llm, prompts[:64], params)
    if args.profile:
        result["gpu_busy_events"] = gpu_busy_events(llm, prompts[: args.max_num_seqs], params, warm_steps=60,
                                                    steps=100)
        result["gpu_busy"] = gpu_busy_fraction(llm, prompts[: args.max_num_seqs], params, warm_steps=60, steps=40)
    finish(result, args.peer_json, args.save)


if __name__ == "__main__":
    main()
