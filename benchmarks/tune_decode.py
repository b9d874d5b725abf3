"""Time the paged decode kernel on W1/W2-like shapes per KV dtype and page layout, for several tile configs.

    PYTHONPATH=$PWD python3 benchmarks/tune_decode.py [--kinds bf16,int8,int4,fp8] [--layouts head_major,token_major]
                                                      [--int8-paths imma_t,legacy] [--cases w1,w2,w3]
                                                      [--length 800]
                                                      [--w2-splits 4,8,16] [--w3-splits 1,2,4]
                                                      [--grid "64,2,2 64,2,3"]
                                                      [--w1-data .bench/w1_throughput.jsonl --decoded 256]
                                                      [--graph 32] [--w2-length 256]
                                                      [--output tune.json]      (GPU)
Caches are real engine pools: Qwen3-0.6B (28 layers, 8 KV heads, GQA 2, head 128) in 1 MiB pages (9 bf16
tokens a page, 18 int8, 35 int4), 256 requests of --length tokens (800) in shuffled pages, or with --w1-data W1's
own prompts after --decoded steps in the pages the engine would give them (prompt pages in runs, decode pages
interleaved, rows longest first: the uniform case has ranked configs unlike W1 itself), layer 0 read; W2 is
llama-3-8b batch 1
at 384 tokens (bf16 only). int8 runs each of its decode loops ("imma_t", integer K.q^T dots a warp per token
sub-tile; "legacy", K/V dequantized to fp16) over INT8_GRID, labelled "int8-imma_t" / "int8-legacy". Bandwidth counts
the K/V bytes (and scales) read once. Prints one JSON line per best config of each (case, kind, layout), then
a summary: the best config per kind (paste into DECODE_CONFIGS in kernels/triton/attention.py, with its
"int8" path), head-major vs token-major per kind, and each kind's best W1 time against bf16's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import print_tune  # noqa: E402
from benchmarks.gemv_bench import seconds_per_call  # noqa: E402
from dflash2.config import ModelArchConfig  # noqa: E402
from dflash2.engine.kv.layout import KVLayout  # noqa: E402
from dflash2.kernels.triton import attention as tri  # noqa: E402

CASES = {"w1": dict(batch=256, length=800, layers=28, kv_heads=8, group=2, dim=128),
         "w2": dict(batch=1, length=384, layers=32, kv_heads=8, group=4, dim=128),
         # W3's decode steps: Qwen3-0.6B, 32 requests of 256-prompt + up to 64 new tokens
         "w3": dict(batch=32, length=320, layers=28, kv_heads=8, group=2, dim=128)}
GRID = list(itertools.product((16, 32, 64), (2, 4), (1, 2)))  # BLOCK_N, warps, stages: 12 compiles a run
# int8 (per decode loop): larger tiles and one warp too (the imma loop's softmax has no cross-warp reduction at 1)
INT8_GRID = list(itertools.product((32, 64, 128), (1, 2, 4), (2,))) + [(64, 2, 3), (128, 4, 3)]


def engine_pages(prompt_lengths: list[int], decoded: int, tokens_per_page: int) -> tuple[list[list[int]], list[int]]:
    """Page ids as the engine hands them out to these requests, and their lengths, after `decoded` steps of
    decoding together: each prompt's pages in one run at its prefill (requests in order), then one page at a
    time as a request's tokens cross a page boundary, in step order (so decode pages interleave across
    requests). Rows come longest first, as the runner orders decode rows."""
    next_page = 0
    tables: list[list[int]] = []
    for length in prompt_lengths:
        count = -(-length // tokens_per_page)
        tables.append(list(range(next_page, next_page + count)))
        next_page += count
    lengths = list(prompt_lengths)
    for _ in range(decoded):
        for i, table in enumerate(tables):
            lengths[i] += 1
            if lengths[i] > len(table) * tokens_per_page:
                table.append(next_page)
                next_page += 1
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [tables[i] for i in order], [lengths[i] for i in order]


def case(kind: str, head_major: bool, batch: int, length: int, layers: int, kv_heads: int, group: int, dim: int,
         prompt_lengths: list[int] | None = None, decoded: int = 0):
    """A real cache pool and the decode inputs: `batch` requests of `length` tokens in shuffled pages, or, with
    `prompt_lengths`, those requests after `decoded` steps in the pages the engine would give them."""
    arch = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=kv_heads * group * dim,
                           intermediate_size=64, num_layers=layers, num_heads=kv_heads * group,
                           num_kv_heads=kv_heads, head_dim=dim, max_position_embeddings=8192)
    layout = KVLayout.for_model(arch, kind, 1 << 20, head_major=head_major)
    if prompt_lengths:
        tables, request_lengths = engine_pages(prompt_lengths, decoded, layout.tokens_per_page)
        batch = len(tables)
        num_pages = max(max(t) for t in tables) + 1
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in tables]
    else:
        pages_each = -(-length // layout.tokens_per_page)
        num_pages = batch * pages_each
        request_lengths = [length] * batch
        rows = torch.randperm(num_pages, dtype=torch.int64).view(batch, pages_each).tolist()
    pool = torch.zeros(num_pages * layout.page_bytes, dtype=torch.uint8, device="cuda")
    cache = layout.layer_views(pool)[0]
    for view in (cache.k, cache.v):
        if kind in ("bf16", "fp8"):
            view.copy_(torch.randn(view.shape, device="cuda").to(view.dtype))
        else:
            view.view(torch.uint8).copy_(torch.randint(0, 256, view.shape, device="cuda", dtype=torch.uint8))
    for scales in (cache.k_scale, cache.v_scale):
        if scales is not None:
            scales.fill_(0.02)
    table = torch.tensor(rows, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    lengths = torch.tensor(request_lengths, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * sum(request_lengths) * kv_heads * (layout.row_bytes + layout.scale_bytes)
    return q, cache, table, slots, lengths, kv_bytes, layout.tokens_per_page


def measure(name: str, kind: str, layout_name: str, grid: list, int8_path: str | None = None,
            length: int | None = None, prompt_lengths: list[int] | None = None, decoded: int = 0,
            splits: int | None = None, graph_calls: int = 0) -> list[dict]:
    shape = {**CASES[name], **({"length": length} if length else {})}
    q, cache, table, slots, lengths, kv_bytes, tpp = case(kind, layout_name == "head_major", **shape,
                                                          prompt_lengths=prompt_lengths, decoded=decoded)
    splits = splits or tri.decode_num_splits(len(lengths), shape["kv_heads"], group=shape["group"])
    label = f"{kind}-{int8_path}" if int8_path else kind
    rows = []
    for block_n, warps, stages in grid:
        config = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                  **({"int8": int8_path} if int8_path else {})}
        row = {"case": name, "kind": label, "layout": layout_name, "tokens_per_page": tpp, "splits": splits,
               **({"prompts": "w1", "decoded": decoded} if prompt_lengths else {"length": shape["length"]}), **config}
        call = lambda: tri.decode_attention(q, cache.k, cache.v, table, slots, lengths, 0.088, splits,  # noqa: E731
                                            k_scale=cache.k_scale, v_scale=cache.v_scale, config=config)
        try:
            if graph_calls:  # one CUDA graph of that many calls: no host launch time in the figure
                ms = seconds_per_call([call] * graph_calls) * 1e3
            else:
                ms = triton.testing.do_bench(call, warmup=25, rep=100)
        except Exception as e:  # a config that does not compile (shared memory)
            rows.append({**row, "error": str(e)[:80]})
            continue
        rows.append({**row, "us": round(ms * 1e3, 1), "TB_s": round(kv_bytes / ms / 1e9, 2)})
    return rows  # the cache is freed here, for the caching allocator to reuse in the next case


def current(label: str) -> tuple:
    """The (BLOCK_N, warps, stages) decode_attention takes today for a kind label ("int8-imma": that loop's)."""
    config = tri.DECODE_CONFIGS.get(label, tri.DECODE_CONFIG)
    return config["BLOCK_N"], config["num_warps"], config["num_stages"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default="bf16,int8,int4,fp8")
    parser.add_argument("--layouts", default="head_major,token_major")
    parser.add_argument("--int8-paths", default="imma_t,legacy", help="int8 decode loops to time")
    parser.add_argument("--cases", default="w1,w2", help="w2 and w3 run with bf16 only")
    parser.add_argument("--w3-splits", default="1,2,4", help="w3: the split counts to time")
    parser.add_argument("--w2-splits", default="", help="w2: split counts to time (default: the engine's)")
    parser.add_argument("--length", type=int, default=None, help="W1 context tokens (default 800)")
    parser.add_argument("--output", default=None, help="also write every row and the summary as JSON here")
    parser.add_argument("--w1-data", default=None,
                        help="W1's jsonl (.bench/w1_throughput.jsonl): its prompts' lengths, in the pages the engine "
                             "would give them, instead of --length tokens for every row in shuffled pages")
    parser.add_argument("--decoded", type=int, default=256, help="with --w1-data: tokens decoded so far")
    parser.add_argument("--grid", default=None,
                        help="the configs to time, every kind alike: 'BLOCK_N,warps,stages' items separated by spaces")
    parser.add_argument("--graph", type=int, default=0, metavar="N",
                        help="time N calls captured in one CUDA graph (per call; without the host's launch time, "
                             "which do_bench's single launches include: W2's one row is far below it). With "
                             "DFLASH2_PDL=0 the calls do not overlap, so this is each call's latency")
    parser.add_argument("--w2-length", type=int, default=None, help="W2 context tokens (default 384)")
    args = parser.parse_args()
    grid = [tuple(int(v) for v in item.split(",")) for item in args.grid.split()] if args.grid else None
    prompts = None
    if args.w1_data:
        with open(args.w1_data) as f:
            prompts = [len(json.loads(line)["prompt_token_ids"]) for line in f if line.strip()]
    w1 = dict(length=args.length, prompt_lengths=prompts, decoded=args.decoded, graph_calls=args.graph)
    w2 = dict(length=args.w2_length, graph_calls=args.graph)
    kinds, layouts, cases = args.kinds.split(","), args.layouts.split(","), args.cases.split(",")
    results: list[dict] = []
    for kind, layout_name in itertools.product(kinds, layouts):
        if "w1" not in cases:
            break
        if kind == "int8":
            for path in args.int8_paths.split(","):
                results += measure("w1", kind, layout_name, grid or INT8_GRID, path, **w1)
        else:
            results += measure("w1", kind, layout_name, grid or GRID, **w1)
    if "bf16" in kinds and "w2" in cases:
        for layout_name in layouts:
            if not args.w2_splits:  # the engine's split count (16 for one row and 8 KV heads)
                results += measure("w2", "bf16", layout_name, GRID, **w2)
            for splits in [int(s) for s in args.w2_splits.split(",") if s]:
                rows = measure("w2", "bf16", layout_name, grid or GRID, splits=splits, **w2)
                results += [{**r, "kind": f"bf16-splits{splits}"} for r in rows]
    if "bf16" in kinds and "w3" in cases:  # bf16 only, each split count (the engine's rule picks 2)
        for layout_name, splits in itertools.product(layouts, [int(s) for s in args.w3_splits.split(",")]):
            rows = measure("w3", "bf16", layout_name, grid or GRID, splits=splits, graph_calls=args.graph)
            results += [{**r, "kind": f"bf16-splits{splits}"} for r in rows]
    labels = [r["kind"] for r in results if r["case"] == "w1"]
    kinds = list(dict.fromkeys(labels))
    best: dict[tuple, dict] = {}
    for row in results:
        key = (row["case"], row["kind"], row["layout"])
        if "us" in row and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    for row in best.values():
        default = next((r for r in results if (r["case"], r["kind"], r["layout"]) == (row["case"], row["kind"], row["layout"])
                        and (r["BLOCK_N"], r["num_warps"], r["num_stages"]) == current(r["kind"]) and "us" in r), None)
        print(json.dumps({**row, "current_default_us": default and default["us"]}))
    bf16 = best.get(("w1", "bf16", "head_major"))
    summary = {"decode_configs_w1_head_major": {
        kind: {k: best[("w1", kind, "head_major")][k] for k in ("BLOCK_N", "num_warps", "num_stages", "int8")
               if k in best[("w1", kind, "head_major")]}
        for kind in kinds if ("w1", kind, "head_major") in best},
        "w1_head_major_vs_bf16": {kind: {"us": best[("w1", kind, "head_major")]["us"],
                                         "TB_s": best[("w1", kind, "head_major")]["TB_s"],
                                         "bf16_us_over_us": round(bf16["us"] / best[("w1", kind, "head_major")]["us"], 3)}
                                  for kind in kinds if bf16 and ("w1", kind, "head_major") in best},
        "head_major_speedup_w1": {kind: round(best[("w1", kind, "token_major")]["us"] / best[("w1", kind, "head_major")]["us"], 3)
                                  for kind in kinds if ("w1", kind, "token_major") in best and ("w1", kind, "head_major") in best},
        }
    print_tune(results, summary, args.output)


if __name__ == "__main__":
    main()
