"""Decode matmuls (M = 1 by default) on llama-3-8b shapes: cuBLAS bf16, the Triton 16-bit GEMV and the int4 GEMV
of kernels/triton/int4_gemv.py over a few configs; prints one JSON line per (kernel, config, shape), the best
config per kernel (least total time over the shapes) and the best int4 config per shape. A few minutes on an
H200. At M = 1 it also times the int4 GEMV with silu(gate) * up fused on either side (silu_variants): gate_up's
epilogue, as the engine runs it, or down's input.

    PYTHONPATH=$PWD python3 benchmarks/decode_gemv_tune.py [--rows 1] [--output tune.json] [--int4-only]
                                                           [--configs-out int4.json]             (GPU)
    TRITON_INTERPRET=1 python3 benchmarks/decode_gemv_tune.py --smoke --int4-only   (CPU: runs the script)

Every int4 row's result is checked against the shape's default config (1%): a fast wrong config is dropped.

GB/s counts the bytes each kernel reads for the weight (int4: 0.5 B a weight + 4 B a group of scale and zero).

Timing as in gemv_bench.py: one CUDA graph of many calls cycling through L2-cold weight copies.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import gemv_bench  # noqa: E402
from benchmarks.gemv_bench import SHAPES, copies_for, random_packed, timed_row  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.kernels.triton.int4_gemv import int4_config, int4_gemv, pair_gate_up, prepare_int4  # noqa: E402
from dflash2.quantization.formats import WeightFormat  # noqa: E402

# CHUNKS = 32 num_warps (int4_gemv checks it)
INT4_CONFIGS = [dict(BLOCK_N=bn, CHUNKS=32 * w, num_warps=w, num_stages=1, SPLIT_K=sk)
                for bn, w, sk in [(8, 4, 1), (4, 4, 1), (16, 4, 1), (2, 4, 1), (8, 8, 1), (4, 4, 2), (8, 2, 1),
                                  (8, 1, 1), (16, 1, 1), (16, 4, 2), (16, 2, 1), (16, 2, 2)]]
# 16 rows on 4 warps take 168 registers a thread with packed fp16 products (254 with float32 ones: two programs
# an SM; benchmarks/sass_count.py), three programs an SM. Capped (ptxas spills past the cap), four fit at 128
CAPPED_CONFIGS = [{**INT4_CONFIGS[2], "maxnreg": r} for r in (168, 128)]
# PERSISTENT: programs an SM, each walking row tiles with the next tile's words requested ahead (sm_90 registers
# at M = 1, K = 4096 on 4 warps, one step a tile: 96 at 8 rows, 254 at 16; on one warp, four steps a tile and
# no cross-warp sum: 134 / 168; benchmarks/sass_count.py)
PERSISTENT_CONFIGS = [dict(BLOCK_N=bn, CHUNKS=32 * w, num_warps=w, num_stages=1, SPLIT_K=1, PERSISTENT=p)
                      for bn, w, p in [(8, 4, 4), (8, 4, 5), (8, 4, 2), (16, 4, 2), (16, 4, 1), (4, 4, 8),
                                       (8, 2, 8), (8, 1, 16), (16, 1, 8)]]
INT4_CONFIGS += CAPPED_CONFIGS + PERSISTENT_CONFIGS
GEMV16_CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
                  for bn, bk, sk, w, st in [(8, 512, 1, 4, 2), (4, 1024, 1, 4, 3), (8, 1024, 1, 8, 3),
                                            (16, 512, 1, 8, 2), (8, 512, 2, 4, 3), (4, 512, 1, 4, 4)]]


def silu_variants(configs: list[dict], shapes: dict = SHAPES, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The two places the engine can put silu(gate) * up, M = 1, llama-3-8b: in gate_up's epilogue (the paired
    weight, silu_out: what the int4 engine runs) or on down's input (silu_mul, reading [gate | up]); the plain
    GEMVs of the same shapes are the rows above. Each variant at the shape's default config and `configs`."""
    rows = []
    fmt = WeightFormat(4, 128)
    for shape, (n, k), silu_out in (("gate_up_silu_out", shapes["gate_up"], True),
                                    ("down_silu_mul", shapes["down"], False)):
        x = torch.randn(1, k if silu_out else 2 * k, device=gemv_bench.DEVICE).to(dtype)
        out = torch.empty(1, n // 2 if silu_out else n, device=gemv_bench.DEVICE, dtype=dtype)
        weights = []
        for _ in range(copies_for(fmt.storage_bytes(n, k))):
            t = random_packed(fmt, n, k).tensors
            weight = prepare_int4(t["qweight"], t["scales"], t["zeros"], 128)
            weights.append(pair_gate_up(weight) if silu_out else weight)
        default = int4_config(n, k, 1, weights[0]["half2"])
        if silu_out:
            fn = lambda w, c: int4_gemv(x, w, out=out, config=c, silu_out=True)  # noqa: E731
        else:
            fn = lambda w, c: int4_gemv(x, w, out=out, config=c, silu_mul=True)  # noqa: E731
        expected = fn(weights[0], default).float()
        for config in [default] + [c for c in configs if c != default]:
            row = timed_row(shape, 1, "gemv_int4", config, fn, weights, fmt.storage_bytes(n, k), expected)
            if row is not None:
                rows.append(row)
        del weights
    return rows


def engine_configs(rows: list[dict], shapes: dict = SHAPES) -> dict:
    """{"NxK": the fastest int4 config} over the timed rows, for DFLASH2_INT4_CONFIGS: the plain GEMV's rows per
    shape, except gate_up, which the engine runs with SiLU-mul in its epilogue (gate_up_silu_out rows)."""
    best: dict = {}
    for row in rows:
        shape = "gate_up" if row["shape"] == "gate_up_silu_out" else row["shape"]
        if row["kernel"] != "gemv_int4" or shape not in shapes or row["shape"] == "gate_up":
            continue
        if shape not in best or row["us"] < best[shape]["us"]:
            best[shape] = row
    if "gate_up" not in best:  # no SiLU-mul rows (M > 1): the plain gate_up
        plain = [r for r in rows if r["kernel"] == "gemv_int4" and r["shape"] == "gate_up"]
        if plain:
            best["gate_up"] = min(plain, key=lambda r: r["us"])
    return {"x".join(map(str, shapes[shape])): row["config"] for shape, row in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=None)
    parser.add_argument("--rows", type=int, default=1, help="activation rows M (the GEMV takes M <= 4)")
    parser.add_argument("--int4-only", action="store_true", help="skip cuBLAS and the 16-bit GEMV")
    parser.add_argument("--configs-out", default=None,
                        help="write the best int4 config per shape as DFLASH2_INT4_CONFIGS reads it (M = 1; "
                             "gate_up: the best with SiLU-mul in its epilogue, as the engine runs it)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU (TRITON_INTERPRET=1, with --int4-only): tiny shapes, a few configs, float32")
    args = parser.parse_args()
    rows, totals = [], {}
    m = args.rows
    shapes, int4_configs, persistent, capped, dtype = SHAPES, INT4_CONFIGS, PERSISTENT_CONFIGS, CAPPED_CONFIGS, \
        torch.bfloat16
    if args.smoke:
        gemv_bench.DEVICE, gemv_bench.L2_FLUSH_BYTES, gemv_bench.MIN_CALLS, dtype = "cpu", 0, 1, torch.float32
        shapes = {"qkv": (48, 256), "gate_up": (64, 256), "down": (32, 512)}
        int4_configs, persistent, capped = INT4_CONFIGS[:1] + PERSISTENT_CONFIGS[:1], PERSISTENT_CONFIGS[:1], []
    for shape, (n, k) in shapes.items():
        x = torch.randn(m, k, device=gemv_bench.DEVICE).to(dtype)
        out = torch.empty(m, n, device=gemv_bench.DEVICE, dtype=dtype)
        candidates = []
        if not args.int4_only:
            dense = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies_for(n * k * 2))]
            candidates += [("cublas_bf16", {}, lambda w, c: torch.mm(x, w.t(), out=out), dense, n * k * 2)]
            candidates += [("gemv_bf16", c, lambda w, c: qm.gemv(x, {"bits": 16, "n": n, "k": k, "w": w}, out=out,
                                                                  config=c), dense, n * k * 2)
                           for c in GEMV16_CONFIGS[:1]]
        fmt = WeightFormat(4, 128)
        int4 = []
        for _ in range(copies_for(fmt.storage_bytes(n, k))):
            t = random_packed(fmt, n, k).tensors
            int4.append(prepare_int4(t["qweight"], t["scales"], t["zeros"], 128))
        int4_bytes = fmt.storage_bytes(n, k)
        default = int4_config(n, k, m, int4[0]["half2"])
        configs = int4_configs + [c for c in [default] if c not in int4_configs]
        candidates += [("gemv_int4", c, lambda w, c: int4_gemv(x, w, out=out, config=c), int4, int4_bytes)
                       for c in configs]
        expected = int4_gemv(x, int4[0], config=default).float()
        for kernel, config, fn, weights, nbytes in candidates:
            check = expected if kernel.startswith("gemv_int4") else None
            row = timed_row(shape, m, kernel, config, fn, weights, nbytes, check)
            if row is None:
                continue
            rows.append(row)
            totals.setdefault((kernel, json.dumps(config, sort_keys=True)), {})[shape] = row["us"]
        del candidates, int4
        torch.cuda.empty_cache()
    if m == 1:
        rows += silu_variants(int4_configs[:3] + capped + persistent, shapes, dtype)
    best = {}
    for (kernel, config), per_shape in totals.items():
        if len(per_shape) == len(shapes):
            total = sum(per_shape.values())
            if kernel not in best or total < best[kernel]["total_us"]:
                best[kernel] = {"config": json.loads(config), "total_us": round(total, 1), "per_shape": per_shape}
    print("best " + json.dumps(best), flush=True)
    per_shape = {}
    for row in rows:
        if row["kernel"] == "gemv_int4" and (row["shape"] not in per_shape or row["us"] < per_shape[row["shape"]]["us"]):
            per_shape[row["shape"]] = row
    print("best_int4_per_shape " + json.dumps(per_shape), flush=True)
    if args.configs_out and m == 1:
        with open(args.configs_out, "w") as f:
            json.dump(engine_configs(rows, shapes), f, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"gpu": gemv_bench.DEVICE if args.smoke else torch.cuda.get_device_name(0), "M": m,
                       "rows": rows, "best": best, "best_int4_per_shape": per_shape}, f, indent=1)


if __name__ == "__main__":
    main()
