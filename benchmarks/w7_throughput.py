"""W7: 8B throughput on a ShareGPT-like request set (llama-3-8b dummy bf16, EOS ignored), offline LLM.generate.

    python3 ../shared/bench/workloads.py sharegpt-like --out .bench/w7.jsonl
    python3 benchmarks/w7_throughput.py --data .bench/w7.jsonl [--max-num-seqs N ...] [--save]
With no size flags the engine chooses its batch sizes for the device (config.DeviceDefaults); the JSON names
the sizes it ran with. Prints JSON: output and total tok/s, preemptions, the settings, the device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import finish, sync  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", ".bench", "w7.jsonl"))
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--prefill-chunk-size", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--label", default="", help="a name for this run in the JSON")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()

    rows = [json.loads(line) for line in open(args.data)]
    if args.num_prompts:
        rows = rows[: args.num_prompts]
    sizes = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
             if getattr(args, name) is not None}
    started = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", enable_prefix_caching=not args.no_prefix_caching, **sizes)
    load_seconds = time.perf_counter() - started
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in rows]
    # warm-up: a slice of the set with few new tokens, so the kernels are compiled before the clock runs
    llm.generate(prompts[:64], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    sync()
    preempted_before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    chosen = llm.engine.scheduler.config
    result = {"workload": "w7", "engine": "dflash2", "model": args.model, "label": args.label,
              "requests": len(prompts), "prompt_tokens": prompt_tokens, "generated": generated,
              "seconds": round(seconds, 3), "out_tok_s": round(generated / seconds, 1),
              "total_tok_s": round((generated + prompt_tokens) / seconds, 1),
              "preemptions": llm.engine.scheduler.num_preemptions - preempted_before,
              "settings": {"max_num_seqs": chosen.max_num_seqs, "max_num_batched_tokens": chosen.max_num_batched_tokens,
                           "prefill_chunk_size": chosen.prefill_chunk_size, "given": sorted(sizes),
                           "prefix_caching": not args.no_prefix_caching},
              "kv_pages": llm.engine.pool.num_pages, "tokens_per_page": llm.engine.kv.tokens_per_page,
              "load_seconds": round(load_seconds, 1)}
    llm.close()
    finish(result, None, args.save)


if __name__ == "__main__":
    main()
