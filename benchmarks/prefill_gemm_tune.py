"""W2's prefill matmuls with int4 weights (llama-3-8b layer shapes, 128 rows): the Triton tl.dot kernel that
dequantizes tiles (quant_matmul.gemm) over a grid of configs, against cuBLAS on bf16 weights of the same shape;
prints one JSON line per (shape, config), then each shape's best config, and with --configs-out writes those as
DFLASH2_GEMM_CONFIGS reads them ({"4:NxK": config}).

    PYTHONPATH=$PWD python3 benchmarks/prefill_gemm_tune.py [--rows 128] [--output t.json] [--configs-out g.json]
    TRITON_INTERPRET=1 python3 benchmarks/prefill_gemm_tune.py --smoke       (CPU: tiny shape, two configs)

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
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.quantization.formats import WeightFormat, dequantize  # noqa: E402

SHAPES = {name: shape for name, shape in gemv_bench.SHAPES.items() if name != "lm_head"}  # lm_head: one row
# BLOCK_M, BLOCK_N, BLOCK_K (weights; int4: whole groups of 128), num_warps, num_stages
GRID = [c for c in itertools.product((64, 128), (64, 128, 256), (128, 256), (4, 8), (3, 4))
        if not (c[0] == 128 and c[1] == 256 and c[3] == 4)]  # 128 x 256 on 4 warps: too many registers


def configs() -> list[dict]:
    grid = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": w, "num_stages": st,
             "WORDS": 1} for bm, bn, bk, w, st in GRID]
    return [dict(qm.GEMM_CONFIG)] + [c for c in grid if c != qm.GEMM_CONFIG]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--output", default=None)
    parser.add_argument("--configs-out", default=None, help="the best config per shape, as DFLASH2_GEMM_CONFIGS")
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shape, two configs")
    args = parser.parse_args()
    shapes, grid, dtype = SHAPES, configs(), torch.bfloat16
    if args.smoke:
        gemv_bench.DEVICE = "cpu"
        shapes, grid, dtype = {"tiny": (64, 256)}, configs()[:2], torch.float32
    fmt = WeightFormat(4, 128)
    results, best = [], {}
    for shape, (n, k) in shapes.items():
        x = torch.randn(args.rows, k, device=gemv_bench.DEVICE, dtype=dtype)
        out = torch.empty(args.rows, n, device=gemv_bench.DEVICE, dtype=dtype)
        copies = 1 if args.smoke else gemv_bench.copies_for(fmt.storage_bytes(n, k))
        packed = [gemv_bench.random_packed(fmt, n, k) for _ in range(copies)]
        weights = [qm.device_tensors(p, dtype) for p in packed]
        reference = x.float() @ dequantize(fmt, packed[0].tensors).float().T
        candidates = [("triton_gemm_int4", c, lambda w, c: qm.gemm(x, w, out=out, config=c)) for c in grid]
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
        with open(args.configs_out, "w") as f:
            json.dump({f"4:{n}x{k}": best[shape]["config"] for shape, (n, k) in shapes.items() if shape in best},
                      f, indent=1)


if __name__ == "__main__":
    main()
