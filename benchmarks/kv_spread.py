"""Does decode attention slow down when a step's KV pages lie spread over a large pool? (issue 44: W7's decode
attention read KV at ~67% of the H100's bandwidth.)

Llama-3-8B's layer 0 (8 KV heads of 128, GQA 4, bf16) over `--batch` requests of `--length` tokens, timed with
the engine's decode kernel at DECODE_CONFIG (and each --grid config) in three arrangements of the same bytes:

    spread     1 MiB pages holding all 32 layers (the engine's pool), the requests' pages drawn at random from a
               pool of --pool-gib (a long-running server's pages: anywhere in the pool)
    compact    the same layout, the pages drawn from only as many pages as the requests need
    per_layer  one layer's K and V alone in each page (32 KiB), pages drawn from as many as needed: what a
               layer-major pool (each layer's pages side by side) would read

    python3 benchmarks/kv_spread.py --batch 300 --length 500 --pool-gib 48      (GPU)

Prints one JSON object: per arrangement microseconds a call and TB/s of K and V bytes read.

On one H100 (2026-12-07): no difference (300 x 500: 237.5 / 238.5 / 237.4 us; 32 x 1,200: 73.1 / 74.3 / 71.7):
where the pages lie does not matter, the tile config does (DECODE_CONFIG_WIDE_GROUP).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import device_name  # noqa: E402
from dflash2.config import ModelArchConfig  # noqa: E402
from dflash2.engine.kv.layout import KVLayout  # noqa: E402
from dflash2.kernels.triton import attention as tri  # noqa: E402

KV_HEADS, GROUP, DIM = 8, 4, 128


def layout(layers: int, page_bytes: int) -> KVLayout:
    arch = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=KV_HEADS * GROUP * DIM,
                           intermediate_size=64, num_layers=layers, num_heads=KV_HEADS * GROUP,
                           num_kv_heads=KV_HEADS, head_dim=DIM, max_position_embeddings=8192)
    return KVLayout.for_model(arch, "bf16", page_bytes)


def time_case(kv: KVLayout, pool_pages: int, batch: int, length: int, config: dict | None) -> dict:
    tpp = kv.tokens_per_page
    pages_each = -(-length // tpp)
    needed = batch * pages_each
    pool = torch.empty(pool_pages * kv.page_bytes, dtype=torch.uint8, device="cuda")
    cache = kv.layer_views(pool)[0]
    for view in (cache.k, cache.v):  # only the pages read need values; the rest stays uninitialised
        view.normal_()
    table = torch.randperm(pool_pages, device="cuda")[:needed].to(torch.int32).view(batch, pages_each)
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    splits = tri.decode_num_splits(batch, KV_HEADS, group=GROUP)
    call = lambda: tri.decode_attention(q, cache.k, cache.v, table, slots, lengths, 0.088, splits,  # noqa: E731
                                        config=config)
    ms = triton.testing.do_bench(call, warmup=25, rep=200)
    kv_bytes = 2 * batch * length * KV_HEADS * DIM * 2
    del pool, cache
    torch.cuda.empty_cache()
    return {"pool_gib": round(pool_pages * kv.page_bytes / 2 ** 30, 2), "tokens_per_page": tpp, "splits": splits,
            "us": round(ms * 1e3, 1), "TB_s": round(kv_bytes / ms / 1e9, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=300)
    parser.add_argument("--length", type=int, default=500)
    parser.add_argument("--pool-gib", type=float, default=48.0)
    parser.add_argument("--grid", default="", help='extra configs for "spread", e.g. "64,4,2 32,4,3"')
    args = parser.parse_args()
    engine = layout(32, 1 << 20)
    one_layer = layout(1, engine.bytes_per_token // engine.num_layers * engine.tokens_per_page)  # as many tokens
    needed = args.batch * -(-args.length // engine.tokens_per_page)
    spread_pages = int(args.pool_gib * 2 ** 30) // engine.page_bytes
    base = tri.DECODE_CONFIG
    result = {"device": device_name(), "batch": args.batch, "length": args.length, "config": base,
              "spread": time_case(engine, spread_pages, args.batch, args.length, base),
              "compact": time_case(engine, needed, args.batch, args.length, base),
              "per_layer": time_case(one_layer, needed, args.batch, args.length, base)}
    for item in args.grid.split():
        block_n, warps, stages = (int(v) for v in item.split(","))
        config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        result[f"spread_{item}"] = time_case(engine, spread_pages, args.batch, args.length, config)
        result[f"per_layer_{item}"] = time_case(one_layer, needed, args.batch, args.length, config)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
