"""The MoE router's time a call inside a CUDA graph of 48 calls (a qwen3-30b-a3b step's layers, each with its own
gate): kernels/triton/moe_router.py's one launch against SparseMoeBlock's torch ops (linear, softmax, topk, sum,
div, cast), bf16, 128 experts, hidden 2048, top-8, at 1 and 10 tokens; and the share of ids the two agree on.

    python3 benchmarks/moe_router_bench.py [--output router.json]      (GPU; prints JSON)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dflash2.kernels.triton.moe_router import moe_route  # noqa: E402
from dflash2.models.moe import torch_route  # noqa: E402


def per_call_us(fn, x, gates):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for g in gates[:2]:
            fn(x, g)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for g in gates:
            fn(x, g)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / 50 / len(gates), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    gates = [(torch.randn(128, 2048, device="cuda") * 0.05).bfloat16() for _ in range(48)]
    out = {"device": torch.cuda.get_device_name()}
    for t in (1, 10):
        x = torch.randn(t, 2048, device="cuda").bfloat16()
        out[f"T{t}"] = {
            "kernel_us": per_call_us(lambda x, g: moe_route(x, g, 8, True, torch.bfloat16), x, gates),
            "torch_us": per_call_us(lambda x, g: torch_route(x, g, 8, True, torch.bfloat16), x, gates)}
        a, b = moe_route(x, gates[0], 8, True, torch.bfloat16), torch_route(x, gates[0], 8, True, torch.bfloat16)
        out[f"T{t}"]["same_ids_share"] = float((a[1] == b[1]).float().mean())
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
