"""M=1 decode matmuls on llama-3-8b shapes: cuBLAS bf16 vs the Triton 16-bit GEMV vs the int4 GEMV
(kernels/triton/int4_gemv.py), each over a few configs; prints one JSON line per (kernel, config, shape)
and the best config per kernel (least total time over the shapes) to paste.

    PYTHONPATH=$PWD python3 benchmarks/decode_gemv_tune.py [--output tune.json]        (GPU)

Timing as in gemv_bench.py: one CUDA graph of many calls cycling through L2-cold weight copies.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gemv_bench import SHAPES, copies_for, cycle, random_packed, seconds_per_call  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.kernels.triton.int4_gemv import int4_gemv, prepare_int4  # noqa: E402
from dflash2.quantization.formats import WeightFormat  # noqa: E402

INT4_CONFIGS = [dict(BLOCK_N=bn, T=t, num_warps=w, num_stages=st, SPLIT_K=0)
                for bn, t, w, st in [(64, 1, 4, 3), (32, 1, 4, 3), (64, 2, 4, 3), (128, 1, 8, 3), (64, 1, 4, 4),
                                     (32, 2, 4, 4), (64, 1, 8, 2), (128, 1, 4, 2)]]
GEMV16_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
                  for bn, bk, sk, w, st in [(8, 512, 1, 4, 2), (4, 1024, 1, 4, 3), (8, 1024, 1, 8, 3),
                                            (16, 512, 1, 8, 2), (8, 512, 2, 4, 3), (4, 512, 1, 4, 4)]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rows, totals = [], {}
    for shape, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda").bfloat16()
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        dense = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies_for(n * k * 2))]
        candidates = [("cublas_bf16", {}, lambda w, c: torch.mm(x, w.t(), out=out), dense, n * k * 2)]
        candidates += [("gemv_bf16", c, lambda w, c: qm.gemv(x, {"bits": 16, "n": n, "k": k, "w": w}, out=out,
                                                              config=c), dense, n * k * 2) for c in GEMV16_CONFIGS]
        fmt = WeightFormat(4, 128)
        int4 = []
        for _ in range(copies_for(fmt.storage_bytes(n, k))):
            t = random_packed(fmt, n, k).tensors
            int4.append(prepare_int4(t["qweight"], t["scales"], t["zeros"], 128))
        int4_bytes = n * k // 2 + 2 * 4 * n * (k // 128)
        candidates += [("gemv_int4", c, lambda w, c: int4_gemv(x, w, out=out, config=c), int4, int4_bytes)
                       for c in INT4_CONFIGS]
        for kernel, config, fn, weights, nbytes in candidates:
            try:
                seconds = seconds_per_call(cycle(lambda w: fn(w, config), weights))
            except Exception as e:  # a config that does not compile
                print(json.dumps({"shape": shape, "kernel": kernel, "config": config, "error": str(e)[:100]}))
                continue
            row = {"shape": shape, "kernel": kernel, "config": config, "us": round(seconds * 1e6, 2),
                   "GB_s": round(nbytes / seconds / 1e9, 1)}
            rows.append(row)
            key = (kernel, json.dumps(config, sort_keys=True))
            totals.setdefault(key, {})[shape] = row["us"]
            print(json.dumps(row), flush=True)
        del dense, int4
        torch.cuda.empty_cache()
    best = {}
    for (kernel, config), per_shape in totals.items():
        if len(per_shape) == len(SHAPES):
            total = sum(per_shape.values())
            if kernel not in best or total < best[kernel]["total_us"]:
                best[kernel] = {"config": json.loads(config), "total_us": round(total, 1), "per_shape": per_shape}
    print("best " + json.dumps(best), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
