"""How fast could W7 run at all? A roofline replay of the scheduler's steps (issue 44).

W7's requests (prompt and output lengths) go through a simplified copy of the engine's schedule: up to
--max-num-seqs running, a token budget of --max-num-batched-tokens a step, decodes first, then prompts in order
(whole, or what the budget leaves), admitted while the KV pool (--kv-tokens) holds their prompts and outputs so
far. Each step then costs what the hardware needs at least: max(the weights' read, its tokens' GEMM FLOPs) plus
its decode rows' KV read, at the given TFLOPS and TB/s (llama-3-8b: 16 GB of weights, 15 GFLOP and 128 KiB of KV
a token). No kernel, launch or host time: the figure is an upper bound on tok/s for any engine that decodes one
token a step per request.

    python3 benchmarks/w7_floor.py --data .bench/w7.jsonl [--tflops 800 --tb-s 3.35] [--longest-first]

On the H100's 800 TFLOPS and 3.35 TB/s: 15.7 s, 14,772 out tok/s, over 1,050 steps (W7's 1,024-token requests set
the step count); FCFS and longest-first ordering end within 0.2% of each other (2026-12-07).
"""
from __future__ import annotations

import argparse
import json

WEIGHT_BYTES = 16.06e9  # llama-3-8b bf16
FLOP_PER_TOKEN = 2 * 7.5e9  # the linear layers (the LM head only for sampled rows: left out)
KV_BYTES_PER_TOKEN = 131072  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def step_ms(tokens: int, decode_context: int, tflops: float, tb_s: float) -> float:
    weights = WEIGHT_BYTES / (tb_s * 1e12)
    compute = tokens * FLOP_PER_TOKEN / (tflops * 1e12)
    return (max(weights, compute) + decode_context * KV_BYTES_PER_TOKEN / (tb_s * 1e12)) * 1e3


def replay(requests: list[tuple[int, int]], max_num_seqs: int, budget: int, kv_tokens: int, tflops: float,
           tb_s: float) -> tuple[float, int]:
    """(seconds, steps) for (prompt, output) requests in this order."""
    waiting = list(requests)
    running: list[list[int]] = []  # [prompt tokens left, tokens in KV, output tokens left]
    seconds, steps = 0.0, 0
    while waiting or running:
        decodes = [r for r in running if r[0] == 0]
        tokens, context = len(decodes), sum(r[1] for r in decodes)
        left = budget - tokens
        prefilled = []
        for r in running:
            if r[0] and left > 0:
                n = min(r[0], left)
                r[0], r[1], left, tokens = r[0] - n, r[1] + n, left - n, tokens + n
                prefilled.append(r)
        held = sum(r[1] + r[2] for r in running)
        while waiting and len(running) < max_num_seqs and left > 0 and held + waiting[0][0] <= kv_tokens:
            prompt, output = waiting.pop(0)
            n = min(prompt, left)
            r = [prompt - n, n, output]
            running.append(r)
            prefilled.append(r)
            left, tokens, held = left - n, tokens + n, held + prompt
        seconds += step_ms(tokens, context, tflops, tb_s) / 1e3
        steps += 1
        for r in decodes:
            r[1], r[2] = r[1] + 1, r[2] - 1
        for r in prefilled:
            if r[0] == 0:
                r[2] -= 1  # a finished prompt samples the first output token
        running = [r for r in running if r[2] > 0]
    return seconds, steps


# dense bf16 TFLOPS a GEMM reaches (of the 989 peak) and the HBM's TB/s, by a substring of the device's name
DEVICE_SPECS = {"H100": (800.0, 3.35), "H200": (800.0, 4.8)}


def device_floor(device: str, requests: list[tuple[int, int]], max_num_seqs: int, budget: int,
                 kv_tokens: int) -> dict | None:
    """The replay's result on a device DEVICE_SPECS knows (None for others): w7_throughput.py's "roofline"."""
    spec = next((v for k, v in DEVICE_SPECS.items() if k in device), None)
    if spec is None:
        return None
    seconds, steps = replay(requests, max_num_seqs, budget, kv_tokens, *spec)
    output = sum(o for _, o in requests)
    return {"out_tok_s": round(output / seconds, 1), "seconds": round(seconds, 2), "steps": steps,
            "tflops": spec[0], "tb_s": spec[1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=".bench/w7.jsonl")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-tokens", type=int, default=50479 * 8, help="the pool's tokens (W7's H100 run)")
    parser.add_argument("--tflops", type=float, default=800.0)
    parser.add_argument("--tb-s", type=float, default=3.35)
    parser.add_argument("--longest-first", action="store_true", help="admit by output length, longest first")
    args = parser.parse_args()
    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    requests = [(len(r["prompt_token_ids"]), r["max_tokens"]) for r in rows]
    if args.longest_first:
        requests.sort(key=lambda r: -r[1])
    seconds, steps = replay(requests, args.max_num_seqs, args.max_num_batched_tokens, args.kv_tokens, args.tflops,
                            args.tb_s)
    output = sum(o for _, o in requests)
    print(json.dumps({"requests": len(requests), "output_tokens": output, "steps": steps,
                      "seconds": round(seconds, 2), "out_tok_s": round(output / seconds, 1), "tflops": args.tflops,
                      "tb_s": args.tb_s, "longest_first": args.longest_first}))


if __name__ == "__main__":
    main()
