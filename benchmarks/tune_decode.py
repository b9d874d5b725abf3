"""Time the paged decode kernel on W1-like shapes for several tile configs; prints JSON rows, best first.

    python3 benchmarks/tune_decode.py     (GPU)
Shapes: qwen3-0.6b (8 KV heads, GQA 2, head 128), bf16, 9 tokens a page, 256 requests of ~800 tokens,
and llama-3-8b batch 1 at 384 tokens. Bandwidth counts K and V bytes read once.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from dflash2.kernels.triton import attention as tri  # noqa: E402


def case(batch: int, length: int, kv_heads: int, group: int, dim: int, tokens_per_page: int):
    pages_each = -(-length // tokens_per_page)
    num_pages = batch * pages_each
    k = torch.randn(num_pages, tokens_per_page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, pages_each)
    q = torch.randn(batch, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    kv_bytes = 2 * batch * length * kv_heads * dim * 2
    return q, k, v, table, slots, lengths, kv_bytes


def main() -> None:
    results = []
    for name, shape in {"w1": (256, 800, 8, 2, 128, 9), "w2": (1, 384, 8, 4, 128, 16)}.items():
        q, k, v, table, slots, lengths, kv_bytes = case(*shape)
        splits = tri.decode_num_splits(shape[0], shape[2])
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            tri.DECODE_CONFIG.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = triton.testing.do_bench(
                    lambda: tri.decode_attention(q, k, v, table, slots, lengths, 0.088, splits), warmup=25, rep=100)
            except Exception as e:  # a config that does not compile (shared memory)
                results.append({"case": name, "BLOCK_N": block_n, "warps": warps, "stages": stages, "error": str(e)[:80]})
                continue
            results.append({"case": name, "BLOCK_N": block_n, "warps": warps, "stages": stages,
                            "us": round(ms * 1e3, 1), "TB_s": round(kv_bytes / ms / 1e9, 2)})
    for name in ("w1", "w2"):
        rows = sorted((r for r in results if r["case"] == name and "us" in r), key=lambda r: r["us"])
        for row in rows[:6]:
            print(json.dumps(row))
        default = [r for r in rows if (r["BLOCK_N"], r["warps"], r["stages"]) == (32, 4, 2)]
        print("default", json.dumps(default))


if __name__ == "__main__":
    main()
