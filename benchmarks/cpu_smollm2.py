"""C1: the bundled SmolLM2-135M on this CPU. Prints JSON: single-stream decode tok/s and 16-concurrent tok/s.

    .venv/bin/python benchmarks/cpu_smollm2.py [--new-tokens 128] [--concurrency 16] [--dtype bfloat16]
                                               [--model DIR]   (e.g. a `dflash2 convert` output)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from dflash2 import LLM, SamplingParams

PROMPT = "Write a long story about a robot who learns to paint."


def single_stream(llm: LLM, new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    prompt = {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": PROMPT}])}
    llm.generate(prompt, SamplingParams(max_tokens=4))  # warm-up
    engine = llm.engine
    engine.add_request(prompt, params)
    engine.step()  # prefill + first token: time-to-first-token, not decode
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return {"decode_tokens": steps, "decode_seconds": round(elapsed, 3), "decode_tok_s": round(steps / elapsed, 1)}


def concurrent(llm: LLM, new_tokens: int, count: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": f"{PROMPT} Part {i}."}])}
               for i in range(count)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": count, "generated_tokens": generated, "seconds": round(elapsed, 3),
            "total_tok_s": round(generated / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU) or bfloat16")
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled model)")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=max(16, args.concurrency), dtype=args.dtype)
    quant = llm.engine.model.quant
    model = args.model or "SmolLM2-135M-Instruct Q4_1, dequantized"
    result = {"benchmark": "c1_cpu_smollm2", "engine": "dflash2", "model": model,
              "weights": "float" if quant is None else {g: quant.bits_for(g) for g in ("embed", "qkv", "o_proj", "ffn", "lm_head")},
              "dtype": str(llm.engine.model.dtype),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "single_stream": single_stream(llm, args.new_tokens),
              "concurrent": concurrent(llm, args.new_tokens, args.concurrency)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
