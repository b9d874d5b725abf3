"""W3's decode matmuls (Qwen3-0.6B, bf16, a small batch's 2-16 rows): cuBLAS against the Triton skinny GEMM
(kernels/triton/skinny_gemm.py) over a grid of configs; prints one JSON line per (shape, rows, kernel, config)
and, per rows, each shape's best skinny config against cuBLAS, for each case of --cases (CASES: how the engine may
run the shape: plain, or gate_up with SiLU-mul in its epilogue).

    PYTHONPATH=$PWD python3 benchmarks/small_m_tune.py [--rows 16] [--output tune.json]
        [--configs-out skinny.json] [--shapes qwen3-30b-a3b]                          (GPU, ~2 min)
    TRITON_INTERPRET=1 python3 benchmarks/small_m_tune.py --smoke                     (CPU: runs the script)

--configs-out writes the best config per plain case at the largest --rows, {"NxK": config}, for
DFLASH2_SKINNY_CONFIGS. Timing as in gemv_bench.py: one CUDA graph of many calls cycling through L2-cold weight
copies (with programmatic dependent launch on, consecutive skinny calls overlap as in a step).

Why: a W3 decode step of ~11 rows took 1.50 ms on the device against 0.885 ms at one row (seventeenth session's
step trace); the eleventh session's profile at 32 rows had cuBLAS's four layer GEMMs at ~1.3 TB/s (23.8 us a
layer for 31.5 MB of weights). The twelfth session's version of this tune timed quant_matmul's dequantizing
tl.dot GEMM, which lost on qkv and gate_up (results/s12/call1_small_m.txt).
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
from dflash2.kernels.triton import skinny_gemm as sg  # noqa: E402
from dflash2.layers.linear import silu_and_mul  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
# --shapes qwen3-30b-a3b: W6's dense projections at 2-16 rows (cuBLAS at ~1.6 TB/s in its 10-row decode step,
# tenth session; its MLPs are experts, which run in fused_moe)
MODEL_SHAPES = {"qwen3-0.6b": dict(SHAPES),
                "qwen3-30b-a3b": {name: shape for name, shape in gemv_bench.MODEL_SHAPES["qwen3-30b-a3b"].items()
                                  if name != "lm_head"}}
# how the engine may run a shape (--cases): "plain" x @ W^T; "silu_out": the weight is [gate | up] and the result
# silu(gate) * up (cuBLAS: the matmul, then silu_and_mul; skinny: in its epilogue). (down with SiLU-mul on the
# skinny GEMM's loads took 10.16 us against 8.39 for silu_and_mul + cuBLAS, twentieth session: that variant is gone)
CASES = {"qkv": "plain", "o_proj": "plain", "gate_up": "plain", "down": "plain", "gate_up_silu_out": "silu_out"}
CASE_SHAPES = {"gate_up_silu_out": "gate_up"}
# BLOCK_N, BLOCK_K, SPLIT_K (None: skinny_split_k's choice), num_warps, num_stages
GRID = ([(bn, bk, sk, 4, 4) for bn, bk, sk in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, None))
         if bn * bk <= 8192]
        + [(32, 128, None, 4, 3), (16, 256, None, 4, 3), (64, 64, None, 4, 4), (32, 64, None, 4, 4),
           (32, 128, None, 2, 4), (16, 256, None, 2, 4), (64, 128, None, 8, 4), (32, 256, None, 8, 4)])


def configs() -> list[dict]:
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st, **({"SPLIT_K": sk} if sk else {})}
            for bn, bk, sk, nw, st in GRID]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16")
    parser.add_argument("--output", default=None)
    parser.add_argument("--configs-out", default=None)
    parser.add_argument("--cases", default=None, help=f"of {', '.join(CASES)} (default: the model's shapes)")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, two configs")
    args = parser.parse_args()
    model_shapes = MODEL_SHAPES[args.shapes]
    cases = args.cases.split(",") if args.cases else list(model_shapes)
    unknown = [case for case in cases if CASE_SHAPES.get(case, case) not in model_shapes]
    if unknown:
        parser.error(f"{args.shapes} has no {', '.join(unknown)} (its shapes: {', '.join(model_shapes)})")
    shapes = {case: model_shapes[CASE_SHAPES.get(case, case)] for case in cases}
    dtype = torch.bfloat16
    if args.smoke:
        gemv_bench.DEVICE = "cpu"
        shapes = {case: (64, 128) for case in cases}
        dtype = torch.float16  # the interpreter's tl.dot gets bfloat16 wrong
    all_rows = [int(r) for r in args.rows.split(",")]
    results, best = [], {}
    for rows, (shape, (n, k)) in itertools.product(all_rows, shapes.items()):
        mode = CASES[shape]
        x = torch.randn(rows, k, device=gemv_bench.DEVICE, dtype=dtype)
        out = torch.empty(rows, n // 2 if mode == "silu_out" else n, device=gemv_bench.DEVICE, dtype=dtype)
        copies = 1 if args.smoke else gemv_bench.copies_for(n * k * 2)
        weights = [(torch.randn(n, k, device=gemv_bench.DEVICE) * 0.02).to(dtype) for _ in range(copies)]
        grid = configs()[:2] if args.smoke else configs()
        if mode == "silu_out":
            candidates = [("cublas", {}, lambda w, c: silu_and_mul(torch.mm(x, w.t())))]
        else:
            candidates = [("cublas", {}, lambda w, c: torch.mm(x, w.t(), out=out))]
        candidates += [("skinny", c, lambda w, c: sg.skinny_gemm(x, w, out=out, silu_out=mode == "silu_out",
                                                                 config=c)) for c in grid]
        reference = x.float() @ weights[0].float().T
        if mode == "silu_out":
            reference = silu_and_mul(reference.to(dtype)).float()
        for kernel, config, fn in candidates:
            row = gemv_bench.timed_row(shape, rows, kernel, config, fn, weights, n * k * 2, reference)
            if row is None:
                continue
            results.append(row)
            key = (rows, shape, kernel)
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    summary = {f"M={rows} {shape}": {"cublas_us": best[(rows, shape, "cublas")]["us"],
                                     "skinny_us": best[(rows, shape, "skinny")]["us"],
                                     "skinny_config": best[(rows, shape, "skinny")]["config"]}
               for rows, shape, kernel in best if kernel == "cublas" and (rows, shape, "skinny") in best}
    print_tune(results, summary, args.output)
    if args.configs_out:
        top = max(all_rows)
        table = {f"{n}x{k}": best[(top, shape, "skinny")]["config"] for shape, (n, k) in shapes.items()
                 if (top, shape, "skinny") in best and CASES[shape] == "plain"}
        with open(args.configs_out, "w") as f:
            json.dump(table, f, indent=1)
        print("configs", json.dumps(table))


if __name__ == "__main__":
    main()
