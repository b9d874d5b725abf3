"""W3's decode matmuls (Qwen3-0.6B, bf16, 8-32 rows): cuBLAS against the Triton tl.dot kernel
(quant_matmul.gemm on a 16-bit weight) over a grid of configs with one tile along M; prints one JSON line per
(shape, rows, kernel, config) and, per rows, each shape's best Triton config against cuBLAS.

    PYTHONPATH=$PWD python3 benchmarks/small_m_tune.py [--rows 16,32] [--output tune.json]     (GPU, ~2 min)
    TRITON_INTERPRET=1 python3 benchmarks/small_m_tune.py --smoke                          (CPU: runs the script)

Why: a W3 decode step (32 rows) spends ~24 us a layer in cuBLAS for 31.5 MB of weights (~1.3 TB/s; eleventh
session, benchmarks/decode_profile.py). The tenth session's switch to this kernel used BLOCK_M 16 (two tiles
at 32 rows: the weights read twice) with SPLIT_K 4, and lost (2.68 against 1.58 ms a decode step). Timing as in
gemv_bench.py: one CUDA graph of many calls cycling through L2-cold weight copies.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import gemv_bench  # noqa: E402
from benchmarks.common import print_tune  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
# BLOCK_N, BLOCK_K, SPLIT_K, num_stages (4 warps; BLOCK_M: the rows rounded up to a power of two, at least 16)
GRID = list(itertools.product((32, 64, 128), (64, 128), (1, 2, 4), (3,)))


def configs(rows: int) -> list[dict]:
    block_m = max(16, triton.next_power_of_2(rows))
    return [{"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": 4, "num_stages": st,
             "WORDS": 1} for bn, bk, sk, st in GRID]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--output", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, two configs")
    args = parser.parse_args()
    shapes, grid = SHAPES, None
    if args.smoke:
        gemv_bench.DEVICE = "cpu"
        shapes = {"tiny": (64, 128)}
    results, best = [], {}
    for rows, (shape, (n, k)) in itertools.product([int(r) for r in args.rows.split(",")], shapes.items()):
        dtype = torch.bfloat16 if not args.smoke else torch.float32
        x = torch.randn(rows, k, device=gemv_bench.DEVICE, dtype=dtype)
        out = torch.empty(rows, n, device=gemv_bench.DEVICE, dtype=dtype)
        copies = 1 if args.smoke else gemv_bench.copies_for(n * k * 2)
        weights = [(torch.randn(n, k, device=gemv_bench.DEVICE) * 0.02).to(dtype) for _ in range(copies)]
        grid = configs(rows)[:2] if args.smoke else configs(rows)
        candidates = [("cublas", {}, lambda w, c: torch.mm(x, w.t(), out=out))]
        candidates += [("triton_gemm", c, lambda w, c: qm.gemm(x, {"bits": 16, "n": n, "k": k, "w": w}, out=out,
                                                                config=c)) for c in grid]
        reference = x.float() @ weights[0].float().T
        for kernel, config, fn in candidates:
            row = gemv_bench.timed_row(shape, rows, kernel, config, fn, weights, n * k * 2, reference)
            if row is None:
                continue
            results.append(row)
            key = (rows, shape, kernel)
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    summary = {f"M={rows} {shape}": {"cublas_us": best[(rows, shape, "cublas")]["us"],
                                     "triton_us": best[(rows, shape, "triton_gemm")]["us"],
                                     "triton_config": best[(rows, shape, "triton_gemm")]["config"]}
               for rows, shape, kernel in best if kernel == "cublas" and (rows, shape, "triton_gemm") in best}
    print_tune(results, summary, args.output)


if __name__ == "__main__":
    main()
