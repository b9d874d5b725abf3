"""Prefill matmuls of quantized weights (llama-3-8b layer shapes, 128 rows: W2's prompt) over a grid of configs,
against cuBLAS on bf16 weights of the same shape: `--kernel int4_gemm` (the default) tunes int4 weights on
kernels/triton/int4_gemm.py, `--kernel gemm --bits 8|6` the general tl.dot kernel that dequantizes tiles
(quant_matmul.gemm's _gemm_kernel, the int8 and int6 prefill). Prints one JSON line per (shape, config), then
each shape's best config, and with --configs-out writes those as DFLASH2_INT4_GEMM_CONFIGS ({"NxK": config}) or
DFLASH2_GEMM_CONFIGS ({"bits:NxK": config}) reads them (docs/TUNING.md).

    PYTHONPATH=$PWD python3 benchmarks/prefill_gemm_tune.py [--kernel int4_gemm|gemm] [--bits 8] [--rows 128] \
        [--output t.json] [--configs-out g.json] [--shapes down,o_proj] [--splits 1,2,4]
    TRITON_INTERPRET=1 python3 benchmarks/prefill_gemm_tune.py --smoke [--kernel gemm]   (CPU: tiny shape, two configs)

Why: W2 int4's first token took 16.9 ms against bf16's 6.1 (twelfth session, call 7): 11 ms of a 514 ms request,
about 2% of the ratio. The default config (BLOCK_M 64) reads every weight twice at 128 rows.
Timing as in gemv_bench.py: one CUDA graph of many calls cycling through L2-cold weight copies.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import gemv_bench  # noqa: E402
from benchmarks.common import print_tune  # noqa: E402
from dflash2.kernels.triton import int4_gemm as ig  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.quantization.formats import WeightFormat, dequantize  # noqa: E402

SHAPES = {name: shape for name, shape in gemv_bench.SHAPES.items() if name != "lm_head"}  # lm_head: one row
# BLOCK_M, BLOCK_N, BLOCK_K (weights; int4: whole groups of 128), num_warps, num_stages
GRID = [c for c in itertools.product((64, 128), (64, 128, 256), (128, 256), (4, 8), (3, 4))
        if not (c[0] == 128 and c[1] == 256 and c[3] == 4)]  # 128 x 256 on 4 warps: too many registers


# int4_gemm: BLOCK_N, BLOCK_M, BLOCK_K, num_warps, num_stages; each compiles for sm_90 without spills and within
# the H200's 227 KiB of shared memory a block (checked offline). SPLIT_K: int4_gemm's own (about one wave)
# (twenty-first session, call 1: the best 64 x 128 x 128 on 4 warps at 3 stages, two programs an SM; 128 x 64 x 256,
# 256 x 64 and 64 x 64 x 256 lost everywhere and are dropped). maxnreg 168 at 2 stages fits three programs an SM (172 registers otherwise).
INT4_GEMM_GRID = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 256, 8, 2), (64, 128, 128, 4, 3),
                  (64, 128, 128, 4, 4), (64, 128, 128, 4, 2), (128, 64, 128, 8, 3), (128, 64, 128, 4, 4),
                  (64, 64, 128, 4, 4), (64, 64, 128, 4, 3), (64, 64, 128, 4, 2)]
CAPPED = [((64, 128, 128, 4, 2), 168)]


def configs() -> list[dict]:
    grid = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": w, "num_stages": st,
             "WORDS": 1} for bm, bn, bk, w, st in GRID]
    return [dict(qm.GEMM_CONFIG)] + [c for c in grid if c != qm.GEMM_CONFIG]


def int4_gemm_configs(n: int, k: int, splits: list[int] | None = None) -> list[dict]:
    """The grid (with int4_gemm's own split along K), or with `splits` the shape's default config at each of
    those SPLIT_K values (its own split first)."""
    default = ig.int4_gemm_config(n, k, 1 << 20)
    if splits:
        return [default] + [{**default, "SPLIT_K": s} for s in splits if s != default.get("SPLIT_K")]
    grid = [{"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
            for bn, bm, bk, w, st in INT4_GEMM_GRID]
    grid += [{"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "maxnreg": r}
             for (bn, bm, bk, w, st), r in CAPPED]
    return [default] + [c for c in grid if c != default] + [{**default, "SPLIT_K": 1}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--output", default=None)
    parser.add_argument("--configs-out", default=None,
                        help="the best config per shape, as DFLASH2_INT4_GEMM_CONFIGS (--kernel gemm: "
                             "DFLASH2_GEMM_CONFIGS) reads it")
    parser.add_argument("--kernel", choices=("int4_gemm", "gemm"), default="int4_gemm")
    parser.add_argument("--bits", type=int, choices=(8, 6), default=8, help="--kernel gemm: the weights' bits")
    parser.add_argument("--splits", default=None,
                        help="comma-separated SPLIT_K values: each shape's default config at each (int4_gemm)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shape, two configs")
    args = parser.parse_args()
    shapes, dtype = SHAPES, torch.bfloat16
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    splits = [int(v) for v in args.splits.split(",")] if args.splits else None
    if args.smoke:
        gemv_bench.DEVICE = "cpu"
        shapes, dtype = {"tiny": (64, 256)}, torch.float32
    fmt = WeightFormat(args.bits, 128 if args.bits == 6 else None) if args.kernel == "gemm" else WeightFormat(4, 128)
    results, best = [], {}
    for shape, (n, k) in shapes.items():
        x = torch.randn(args.rows, k, device=gemv_bench.DEVICE, dtype=dtype)
        out = torch.empty(args.rows, n, device=gemv_bench.DEVICE, dtype=dtype)
        copies = 1 if args.smoke else gemv_bench.copies_for(fmt.storage_bytes(n, k))
        packed = [gemv_bench.random_packed(fmt, n, k) for _ in range(copies)]
        weights = [qm.device_tensors(p, dtype) for p in packed]
        reference = x.float() @ dequantize(fmt, packed[0].tensors).float().T
        if args.kernel == "gemm":
            grid = configs()
            candidates = [(f"triton_gemm_int{args.bits}", c, lambda w, c: qm.gemm(x, w, out=out, config=c))
                          for c in grid]
        else:
            grid = int4_gemm_configs(n, k, splits)
            candidates = [("int4_gemm", c, lambda w, c: ig.int4_gemm(x, w, out=out, config=c)) for c in grid]
        if args.smoke:
            grid, candidates = grid[:2], candidates[:2]
        if not args.smoke:
            dense = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16()
                     for _ in range(gemv_bench.copies_for(n * k * 2))]
            results.append(gemv_bench.timed_row(shape, args.rows, "cublas_bf16", {},
                                                lambda w, c: torch.mm(x, w.t(), out=out), dense, n * k * 2))
            del dense
        for kernel, config, fn in candidates:
            row = gemv_bench.timed_row(shape, args.rows, kernel, config, fn, weights, fmt.storage_bytes(n, k),
                                       reference)
            if row is None:
                continue
            results.append(row)
            if shape not in best or row["us"] < best[shape]["us"]:
                best[shape] = row
        del weights, packed
    summary = {shape: {"us": row["us"], "config": row["config"],
                       "default_us": next((r["us"] for r in results if r["shape"] == shape
                                           and r.get("config") == grid[0]), None)} for shape, row in best.items()}
    print_tune(results, summary, args.output)
    if args.configs_out:
        prefix = f"{args.bits}:" if args.kernel == "gemm" else ""
        with open(args.configs_out, "w") as f:
            json.dump({f"{prefix}{n}x{k}": best[shape]["config"] for shape, (n, k) in shapes.items()
                       if shape in best}, f, indent=1)


if __name__ == "__main__":
    main()
