"""W2 and W7 at tensor-parallel sizes 1 and 2 (issue 46): llama-3-8b dummy bf16 weights, offline LLM.generate.

    python3 ../shared/bench/workloads.py sharegpt-like --out .bench/w7.jsonl
    python3 benchmarks/parallel.py --dataset .bench/w7.jsonl [--tp 1 2] [--output parallel.json]     (GPUs)
    .venv/bin/python benchmarks/parallel.py --cpu-smoke        (a tiny random Llama over gloo: the script runs)

For each size in --tp, one engine after the other in this process (each rank draws the same dummy weights on its
own GPU, so every size holds the same model):
1. W2: one request, --prompt-len (128) prompt tokens, --new-tokens (256) new, greedy; decode tok/s, the best of
   --repeats, after a warm-up.
2. W7: the --dataset requests (jsonl: prompt_token_ids, max_tokens; EOS ignored), all at once: output tok/s.
Greedy tokens: each size's W2 tokens and its first --compare W7 requests' tokens against the first size's; where
they part, the position (bfloat16 all-reduces sum in another order than one GPU: a near tie may flip).
A parallel engine runs eager (no CUDA graphs yet), so TP=1 is also run through the executor (--tp 1 with
--executor-for-tp1) to separate the graphs' share from the split's. JSON out (stdout, and --output).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, print_report, sync  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 32000), (length,), generator=generator).tolist()


def w2(llm: LLM, args: argparse.Namespace) -> dict:
    vocab = llm.engine.model.arch.vocab_size
    prompt = {"prompt_token_ids": random_prompt(args.prompt_len, 0, vocab)}
    llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0))  # warm-up
    best, tokens = None, None
    for _ in range(args.repeats):
        engine = llm.engine
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0)
        sync()
        start = time.perf_counter()
        request_id = engine.add_request(prompt, params).request_id
        first = None
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id == request_id and first is None and output.outputs[0].token_ids:
                    first = time.perf_counter()
                if output.finished:
                    tokens = list(output.outputs[0].token_ids)
        sync()
        end = time.perf_counter()
        run = {"ttft_s": round(first - start, 4), "decode_tok_s": round((len(tokens) - 1) / (end - first), 1),
               "tok_s": round(len(tokens) / (end - start), 1)}
        if best is None or run["decode_tok_s"] > best["decode_tok_s"]:
            best = run
    return {**best, "tokens": tokens}


def w7(llm: LLM, rows: list[dict], args: argparse.Namespace) -> dict:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in rows]
    llm.generate(prompts[:args.warmup_requests], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(rows), "generated": generated, "seconds": round(seconds, 3),
            "out_tok_s": round(generated / seconds, 1), "tokens": [list(o.outputs[0].token_ids)
                                                                   for o in outputs[:args.compare]]}


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def compare(result: dict, reference: dict) -> dict:
    w2_part = first_difference(result["w2"]["tokens"], reference["w2"]["tokens"])
    w7_parts = [first_difference(a, b) for a, b in zip(result["w7"]["tokens"], reference["w7"]["tokens"])]
    return {"w2_tokens_equal": w2_part is None, "w2_first_difference": w2_part,
            "w7_requests_equal": sum(p is None for p in w7_parts), "w7_requests_compared": len(w7_parts),
            "w7_first_differences": [p for p in w7_parts if p is not None]}


def run_size(model: str, tp: int, through_executor: bool, rows: list[dict], args: argparse.Namespace,
             options: dict) -> dict:
    started = time.perf_counter()
    backend = "mp" if through_executor else None
    llm = LLM(model, tensor_parallel_size=tp, distributed_executor_backend=backend, **options)
    load_s = time.perf_counter() - started
    try:
        result = {"tensor_parallel_size": tp, "executor": backend or ("mp" if tp > 1 else "none"),
                  "load_s": round(load_s, 1), "w2": w2(llm, args), "w7": w7(llm, rows, args)}
    finally:
        llm.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def cpu_smoke_setup(args: argparse.Namespace) -> tuple[str, list[dict], dict]:
    """A tiny random Llama and a small ShareGPT-like set on the CPU (gloo ranks)."""
    from tests.tiny_models import build_tiny_model

    directory = tempfile.mkdtemp(prefix="dflash2-parallel-smoke-")
    build_tiny_model("llama", directory)
    generator = torch.Generator().manual_seed(0)
    rows = [{"prompt_token_ids": torch.randint(3, 256, (int(n),), generator=generator).tolist(), "max_tokens": 16}
            for n in torch.randint(4, 40, (12,), generator=generator)]
    args.prompt_len, args.new_tokens, args.repeats, args.warmup_requests = 16, 16, 1, 2
    return directory, rows, dict(max_model_len=128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b", help="a preset (dummy weights)")
    parser.add_argument("--dataset", default=None, help="W7's jsonl (../shared/bench/workloads.py sharegpt-like)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, in order")
    parser.add_argument("--executor-for-tp1", action="store_true",
                        help="run TP=1 through the executor too (eager, NCCL world of one), beside the plain engine")
    parser.add_argument("--num-prompts", type=int, default=None, help="W7: the first N requests of the set")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-requests", type=int, default=64)
    parser.add_argument("--compare", type=int, default=32, help="W7 requests whose tokens are compared across sizes")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--output", default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny random Llama on the CPU (the script runs)")
    args = parser.parse_args()

    if args.cpu_smoke:
        model, rows, options = cpu_smoke_setup(args)
    else:
        if args.dataset is None:
            parser.error("--dataset is needed (or --cpu-smoke)")
        with open(args.dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        model = args.model
        options = dict(load_format="dummy", max_model_len=args.max_model_len,
                       gpu_memory_utilization=args.gpu_memory_utilization)
    if args.num_prompts:
        rows = rows[:args.num_prompts]
    sizes = [(tp, False) for tp in args.tp]
    if args.executor_for_tp1 and 1 in args.tp:
        sizes.insert(args.tp.index(1) + 1, (1, True))
    results = [run_size(model, tp, executor, rows, args, options) for tp, executor in sizes]
    for result in results[1:]:
        result["against_first"] = compare(result, results[0])
    for result in results:
        result["w2"].pop("tokens")
        result["w7"].pop("tokens")
    report = {"workload": "parallel (W2, W7)", "model": model if not args.cpu_smoke else "tiny-llama (cpu smoke)",
              "device": device_name(), "gpus": torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d"),
              "runs": results}
    print_report(report, args.output)


if __name__ == "__main__":
    main()
