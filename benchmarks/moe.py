"""W6: a mixture of experts on the GPU (issue 45): qwen3-30b-a3b dummy weights, bf16.

    python3 benchmarks/moe.py [--output w6.json]              (GPU)
    .venv/bin/python benchmarks/moe.py --cpu-smoke            (a tiny random Qwen3-MoE on the CPU: the script runs)

1. Batch-1 decode (--prompt-len 128, --new-tokens 256): decode tok/s against the memory roofline of a step (the
   weights it reads: attention, router, the k experts each sparse layer selects, the output projection; and the
   live KV), at the device's measured copy bandwidth (benchmarks/roofline.py). Target >= 0.8.
2. Throughput: --concurrency (10) requests of --conc-prompt (2,048) prompt and --conc-output (1,024) output tokens,
   all at once, EOS ignored: output tok/s over the wall time and ms per output token (each request's decode
   time over its tokens after the first, the mean). Anchor: vLLM, Qwen3-30B-A3B, one H100, bf16: 740 output tok/s,
   13.2 ms per output token. Target >= 740 tok/s.
JSON out (stdout, and --output).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import device_name, print_report, sync  # noqa: E402
from benchmarks.roofline import device_bytes_per_s, moe_step_weight_bytes  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402

ANCHOR = {"engine": "vLLM", "model": "Qwen3-30B-A3B", "device": "H100", "dtype": "bf16", "output_tok_s": 740,
          "ms_per_output_token": 13.2}


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (length,), generator=generator).tolist()


def run_requests(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts at once, stepped to the end: wall time, and per request its first-token and end times."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
    sync()
    start = time.perf_counter()
    requests = [engine.add_request({"prompt_token_ids": p}, params).request_id for p in prompts]
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    counts: dict[str, int] = {}
    while engine.has_unfinished():
        for output in engine.step():
            now = time.perf_counter()
            counts[output.request_id] = len(output.outputs[0].token_ids)
            if counts[output.request_id] and output.request_id not in first:
                first[output.request_id] = now
            if output.finished:
                end[output.request_id] = now
    wall = time.perf_counter() - start
    tokens = sum(counts[r] for r in requests)
    per_token = [(end[r] - first[r]) / max(1, counts[r] - 1) for r in requests]
    return {"wall_s": wall, "output_tokens": tokens, "ttft_s": [first[r] - start for r in requests],
            "s_per_output_token": per_token}


def batch_one(llm: LLM, args, vocab: int) -> dict:
    arch = llm.engine.model.arch
    prompt = random_prompt(args.prompt_len, 0, vocab)
    run_requests(llm, [prompt], 16)  # warm-up
    runs = [run_requests(llm, [prompt], args.new_tokens) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["wall_s"])
    decode_s = best["wall_s"] - best["ttft_s"][0]
    decode_tok_s = (best["output_tokens"] - 1) / decode_s
    element = 4 if args.dtype == "float32" else 2
    weights = moe_step_weight_bytes(arch, arch.num_experts_per_tok, element)
    mean_context = args.prompt_len + args.new_tokens / 2
    kv = arch.kv_bytes_per_token(element) * mean_context
    bandwidth = device_bytes_per_s() if torch.cuda.is_available() else None
    ceiling = bandwidth / (weights + kv) if bandwidth else None
    return {"prompt_len": args.prompt_len, "new_tokens": best["output_tokens"],
            "tok_s": round(best["output_tokens"] / best["wall_s"], 1), "decode_tok_s": round(decode_tok_s, 1),
            "ttft_ms": round(best["ttft_s"][0] * 1e3, 2), "step_weight_bytes": weights, "step_kv_bytes": int(kv),
            "roofline_tok_s": None if ceiling is None else round(ceiling, 1),
            "fraction_of_roofline": None if ceiling is None else round(decode_tok_s / ceiling, 3),
            "all_runs_s": [round(r["wall_s"], 4) for r in runs]}


def concurrent(llm: LLM, args, vocab: int) -> dict:
    prompts = [random_prompt(args.conc_prompt, 1 + i, vocab) for i in range(args.concurrency)]
    run_requests(llm, prompts[:2], 8)  # warm-up at this shape
    result = run_requests(llm, prompts, args.conc_output)
    return {"concurrency": args.concurrency, "prompt_len": args.conc_prompt, "output_len": args.conc_output,
            "output_tok_s": round(result["output_tokens"] / result["wall_s"], 1),
            "ms_per_output_token": round(1e3 * statistics.mean(result["s_per_output_token"]), 2),
            "ttft_ms_p50": round(1e3 * statistics.median(result["ttft_s"]), 1), "wall_s": round(result["wall_s"], 2),
            "preemptions": llm.engine.scheduler.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--conc-prompt", type=int, default=2048)
    parser.add_argument("--conc-output", type=int, default=1024)
    parser.add_argument("--skip", choices=("batch1", "concurrent"), action="append", default=[])
    parser.add_argument("--quantization", default=None, help="int8 / int6 / int4: every weight (experts too) of the "
                        "dummy model at that width (embeddings 16-bit)")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny random Qwen3-MoE on the CPU, short runs")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    options = dict(dtype=args.dtype, enable_prefix_caching=False, max_model_len=4096)
    if args.cpu_smoke:
        from tests.tiny_models import build_tiny_model

        model = tempfile.mkdtemp(prefix="w6_smoke_")
        build_tiny_model("qwen3_moe", model)
        args.dtype = "float32"
        options.update(dtype="float32", max_model_len=512)
        args.prompt_len, args.new_tokens, args.repeats = 16, 8, 1
        args.concurrency, args.conc_prompt, args.conc_output = 3, 32, 8
    else:
        model = args.model
        options["load_format"] = "dummy"
    started = time.perf_counter()
    if args.quantization:
        llm = LLM(models=[{"name": "w6", "model": model, "load_format": options.pop("load_format", "auto"),
                           "quantization": args.quantization}], **options)
    else:
        llm = LLM(model, **options)
    load_s = time.perf_counter() - started
    vocab = llm.engine.model.arch.vocab_size
    result = {"workload": "w6", "engine": "dflash2", "model": args.model if not args.cpu_smoke else "tiny qwen3_moe",
              "dtype": options["dtype"], "quantization": args.quantization, "device": device_name(),
              "load_s": round(load_s, 1), "anchor": ANCHOR}
    if "batch1" not in args.skip:
        result["batch1"] = batch_one(llm, args, vocab)
    if "concurrent" not in args.skip:
        result["concurrent"] = concurrent(llm, args, vocab)
        result["target_met"] = result["concurrent"]["output_tok_s"] >= ANCHOR["output_tok_s"] and (
            result.get("batch1", {}).get("fraction_of_roofline") or 0) >= 0.8
    print_report(result, args.output)


if __name__ == "__main__":
    main()
