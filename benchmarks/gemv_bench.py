"""Matmul kernels on llama-3-8b shapes (or --shapes qwen3-30b-a3b): cuBLAS bf16 against the Triton 16-bit GEMV and
int8/int4/int6 kernels, then a sweep of quant_matmul._gemv_kernel's configs (16, 8 and 6 bits; int4 has its own
kernel and tune, decode_gemv_tune.py) at M=1 (prints the GEMV_CONFIGS to paste into kernels/triton/quant_matmul.py;
`--sweep-rows 4` sweeps at 4 rows instead).

    PYTHONPATH=$PWD python3 benchmarks/gemv_bench.py [--output gemv.json] [--sweep-budget-s 240] [--no-sweep]
    TRITON_INTERPRET=1 python3 benchmarks/gemv_bench.py --smoke     (CPU: tiny shapes, checks the script runs)

Each measurement is one CUDA graph of many calls (no launch cost), cycling through enough copies of the weight
that they do not fit in L2 (as in the model, where every layer has its own). GB/s = weight bytes (incl. scales
and zeros) / time per call. M > GEMV_MAX_M runs the tl.dot GEMM for the quantized formats.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.quantization.formats import WeightFormat  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
# --shapes qwen3-30b-a3b: the dense GEMVs of W6's decode step (its experts run in fused_moe); take the per-shape
# entries it suggests, not its default (tuned on these shapes only)
MODEL_SHAPES = {"llama-3-8b": dict(SHAPES),
                "qwen3-30b-a3b": {"qkv": (5120, 2048), "o_proj": (2048, 4096), "lm_head": (151936, 2048)}}
ROWS = (1, 4, 16, 256)
FORMATS = {"int8": WeightFormat(8), "int4": WeightFormat(4, 128), "int6": WeightFormat(6, 128)}
L2_FLUSH_BYTES = 256 << 20  # the copies of a weight cycled through add up to at least this
DEVICE = "cuda"
MIN_CALLS = 24  # calls in one timed graph


def random_packed(fmt: WeightFormat, n: int, k: int) -> PackedWeight:
    """Random codes with plausible scales: the kernels' speed does not depend on the values."""
    tensors = {}
    for name, (shape, dtype) in fmt.tensor_shapes(n, k).items():
        if dtype in (torch.uint8, torch.int8):
            tensors[name] = torch.randint(0, 255, shape, device=DEVICE, dtype=torch.int32).to(dtype)
        elif name == "zeros":
            tensors[name] = torch.full(shape, 7.5, device=DEVICE, dtype=dtype)
        else:
            tensors[name] = (torch.rand(shape, device=DEVICE) * 0.01).to(dtype)
    return PackedWeight(fmt, n, k, tensors)


def weight_bytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))


def copies_for(nbytes: int) -> int:
    return max(1, math.ceil(L2_FLUSH_BYTES / nbytes))


def seconds_per_call(calls: list[Callable[[], Any]], repeats: int = 5) -> float:
    """Capture the calls into one CUDA graph (after an eager warm-up that compiles) and time its replays."""
    if DEVICE != "cuda":  # --smoke
        started = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - started) / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return best


def cycle(fn: Callable[[Any], Any], items: list[Any]) -> list[Callable[[], Any]]:
    count = max(2 * len(items), MIN_CALLS)
    return [lambda item=items[i % len(items)]: fn(item) for i in range(count)]


def row(shape: str, rows: int, kernel: str, seconds: float, nbytes: int, **extra: Any) -> dict[str, Any]:
    return {"shape": shape, "M": rows, "kernel": kernel, "us": round(seconds * 1e6, 2),
            "GB_s": round(nbytes / seconds / 1e9, 1), **extra}


def timed_row(shape: str, rows: int, kernel: str, config: dict, fn: Callable[[Any, dict], torch.Tensor],
              weights: list[Any], nbytes: int, expected: torch.Tensor | None = None) -> dict[str, Any] | None:
    """The tunes' measurement: fn(weight, config) timed over L2-cold weight copies, the row printed and returned;
    None (an error line printed) for a config that does not compile, or whose result on weights[0] is more
    than 1% off `expected` (a fast wrong config must not win)."""
    try:
        seconds = seconds_per_call(cycle(lambda w: fn(w, config), weights))
        got = fn(weights[0], config).float()
    except Exception as e:  # a config that does not compile (registers, shared memory)
        print(json.dumps({"shape": shape, "M": rows, "kernel": kernel, "config": config, "error": str(e)[:100]}))
        return None
    result = row(shape, rows, kernel, seconds, nbytes, config=config)
    if expected is not None:
        result["rel_error"] = round(float((got - expected).norm() / expected.norm()), 5)
        if not result["rel_error"] < 1e-2:
            print(json.dumps({**result, "error": "wrong result"}))
            return None
    print(json.dumps(result), flush=True)
    return result


# -- the table: every kernel at its current defaults ---------------------------------------------------------
def table() -> list[dict[str, Any]]:
    results = []
    for shape, (n, k) in SHAPES.items():
        dense_bytes = n * k * 2
        dense = [(torch.randn(n, k, device=DEVICE) * 0.02).bfloat16() for _ in range(copies_for(dense_bytes))]
        packed = {name: [qm.device_tensors(random_packed(fmt, n, k), torch.bfloat16)
                         for _ in range(copies_for(fmt.storage_bytes(n, k)))] for name, fmt in FORMATS.items()}
        for rows in ROWS:
            x = torch.randn(rows, k, device=DEVICE).bfloat16()
            out = torch.empty(rows, n, device=DEVICE, dtype=torch.bfloat16)
            seconds = seconds_per_call(cycle(lambda w: torch.mm(x, w.t(), out=out), dense))
            results.append(row(shape, rows, "cublas_bf16", seconds, dense_bytes))
            if rows <= qm.GEMV_MAX_M:
                seconds = seconds_per_call(cycle(lambda w: qm.gemv_16bit(x, w, out=out), dense))
                results.append(row(shape, rows, "triton_gemv_bf16", seconds, dense_bytes))
            for name, weights in packed.items():
                if name == "int6" and rows > 1:
                    continue
                run = qm.gemv if rows <= qm.GEMV_MAX_M else qm.gemm
                seconds = seconds_per_call(cycle(lambda w: run(x, w, out=out), weights))
                kind = "gemv" if rows <= qm.GEMV_MAX_M else "gemm"
                results.append(row(shape, rows, f"triton_{kind}_{name}", seconds, weight_bytes(weights[0])))
            print(json.dumps(results[-1]), flush=True)
        del dense, packed
        torch.cuda.empty_cache()
    return results


# -- the M=1 sweep -----------------------------------------------------------------------------------------
def candidate_configs(bits: int) -> list[dict[str, int]]:
    """Tile configs with SPLIT_K=1, likely-good first (the sweep stops at its time budget)."""
    block_ns = (8, 16, 32) if bits == 6 else (4, 8, 16)
    block_ks = (512, 256, 1024) if bits != 16 else (512, 1024, 256)
    configs = []
    for warps, stages, block_n, block_k in itertools.product((4, 8), (2, 1, 3), block_ns, block_ks):
        configs.append({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": 1, "num_warps": warps,
                        "num_stages": stages, **({"WORDS": 1} if bits == 8 else {})})
    configs.sort(key=lambda c: (c["num_stages"] == 3, c["num_warps"] == 8))
    if bits == 8:  # bytes instead of words, for the likeliest tiles
        configs[6:6] = [{**c, "WORDS": 0} for c in configs[:3]]
    return configs


# --sweep-fold: the shapes as a decode step of one row runs them where the layer folds its norms and residual adds
# (models/llama.py fuses_norms): qkv and gate_up norm their input, o_proj and down add into the residual stream
FOLDED = {"qkv": "norm", "gate_up": "norm", "o_proj": "add", "down": "add"}


def sweep(bits: int, budget_s: float, x: torch.Tensor, fold: bool = False) -> dict[str, list[dict[str, Any]]]:
    """shape -> rows sorted fastest first; fold: FOLDED's norms and adds inside the GEMV."""
    fmt = WeightFormat(bits, 128 if bits == 6 else None)
    weights = {}
    for shape, (n, k) in SHAPES.items():
        if bits == 16:
            dense = (torch.randn(n, k, device=DEVICE) * 0.02).bfloat16()
            weights[shape] = [{"bits": 16, "n": n, "k": k, "w": dense, "words": None}]
            weights[shape] += [{**weights[shape][0], "w": dense.clone()} for _ in range(copies_for(n * k * 2) - 1)]
        else:
            weights[shape] = [qm.device_tensors(random_packed(fmt, n, k), torch.bfloat16)
                              for _ in range(copies_for(fmt.storage_bytes(n, k)))]
    inputs = {shape: x[:, :k].contiguous() for shape, (n, k) in SHAPES.items()}
    results: dict[str, list[dict[str, Any]]] = {shape: [] for shape in SHAPES}
    deadline = time.time() + budget_s

    def measure(shape: str, config: dict[str, int]) -> None:
        n, k = SHAPES[shape]
        out = torch.zeros(x.shape[0], n, device=DEVICE, dtype=torch.bfloat16)
        folded = FOLDED.get(shape) if fold else None
        norm = (torch.ones(k, device=DEVICE, dtype=torch.bfloat16), 1e-6) if folded == "norm" else None
        try:
            seconds = seconds_per_call(cycle(lambda w: qm.gemv(inputs[shape], w, out=out, config=config, norm=norm,
                                                               add_out=folded == "add"), weights[shape]))
        except Exception as e:  # a config that does not compile (registers, shared memory)
            results[shape].append({"config": config, "error": str(e)[:120]})
            return
        results[shape].append({"config": config, **row(shape, x.shape[0], f"gemv_{bits}", seconds,
                                                          weight_bytes(weights[shape][0]))})

    for config in candidate_configs(bits):
        if time.time() > deadline:
            break
        for shape in SHAPES:
            measure(shape, config)
    for shape in SHAPES:  # split-K on each shape's two best tiles
        best = sorted((r for r in results[shape] if "us" in r), key=lambda r: r["us"])[:2]
        for entry, split in itertools.product(best, (2, 4)):
            if time.time() < deadline + budget_s / 4:
                measure(shape, {**entry["config"], "SPLIT_K": split})
        results[shape].sort(key=lambda r: r.get("us", float("inf")))
    weights.clear()
    torch.cuda.empty_cache()
    return results


def suggest(bits: int, results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, int]]:
    """One default (least total time over the shapes, among configs timed on all of them) plus per-shape
    overrides, keyed "(bits, N, K)", where a shape's best beats the default by more than 5%."""
    key = lambda config: json.dumps(config, sort_keys=True)  # noqa: E731
    times: dict[str, dict[str, float]] = {}
    for shape, rows in results.items():
        for r in rows:
            if "us" in r:
                times.setdefault(key(r["config"]), {})[shape] = r["us"]
    complete = {c: sum(t.values()) for c, t in times.items() if len(t) == len(results)}
    if not complete:
        return {}
    default = min(complete, key=complete.get)
    configs = {str(bits): json.loads(default)}
    for shape, rows in results.items():
        timed = [r for r in rows if "us" in r]
        if timed and timed[0]["us"] < 0.95 * times[default][shape]:
            configs[str((bits, *SHAPES[shape]))] = timed[0]["config"]
    return configs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-budget-s", type=float, default=240.0, help="for all bit widths together")
    parser.add_argument("--sweep-bits", default="16,8", help="of 16, 8, 6")
    parser.add_argument("--sweep-rows", type=int, default=1,
                        help="activation rows of the sweep (at most GEMV_MAX_M; 4: a decode batch of 4). The suggested "
                             "configs are for these rows; quant_matmul's GEMV_CONFIGS serve 1-4 rows alike")
    parser.add_argument("--sweep-fold", action="store_true",
                        help="sweep qkv / gate_up with the RMSNorm and o_proj / down with the residual add inside the "
                             "GEMV, as a folded layer's one-row step runs them (bits 16 and 4 fold)")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    parser.add_argument("--shapes", choices=sorted(MODEL_SHAPES), default="llama-3-8b")
    args = parser.parse_args()
    SHAPES.clear()
    SHAPES.update(MODEL_SHAPES[args.shapes])
    if args.smoke:
        global DEVICE, ROWS, L2_FLUSH_BYTES, MIN_CALLS
        DEVICE, ROWS, L2_FLUSH_BYTES, MIN_CALLS = "cpu", (1, 20), 1, 1
        args.sweep_budget_s = min(args.sweep_budget_s, 6.0)
        SHAPES.clear()
        SHAPES.update({"qkv": (48, 256), "o_proj": (40, 512)})  # tiny, under the names --sweep-fold folds
    started = time.time()
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    report: dict[str, Any] = {"gpu": gpu, "defaults": {
        "GEMV_MAX_M": qm.GEMV_MAX_M, "GEMV_CONFIGS": {str(b): c for b, c in qm.GEMV_CONFIGS.items()},
        "GEMM_CONFIG": qm.GEMM_CONFIG, "GEMM_SMALL_M_CONFIG": qm.GEMM_SMALL_M_CONFIG}}
    report["table"] = table()
    report["table_s"] = round(time.time() - started, 1)
    save(report, args.output)
    if not args.no_sweep:
        bits_list = [int(b) for b in args.sweep_bits.split(",")]
        if not 1 <= args.sweep_rows <= qm.GEMV_MAX_M:
            parser.error(f"--sweep-rows must be 1..{qm.GEMV_MAX_M}")
        x = torch.randn(args.sweep_rows, max(k for _, k in SHAPES.values()), device=DEVICE).bfloat16()
        report["sweep"], report["suggested_GEMV_CONFIGS"] = {}, {}
        for bits in bits_list:
            results = sweep(bits, args.sweep_budget_s / len(bits_list), x, args.sweep_fold)
            report["sweep"][str(bits)] = {shape: rows[:5] for shape, rows in results.items()}
            report["suggested_GEMV_CONFIGS"].update(suggest(bits, results))
            for shape, rows in results.items():
                print(json.dumps({"bits": bits, "shape": shape, "best": rows[0] if rows else None}), flush=True)
            save(report, args.output)
        suggested = {str(b): c for b, c in qm.GEMV_CONFIGS.items() if str(b) not in report["suggested_GEMV_CONFIGS"]
                     and isinstance(b, int)}  # bits not swept keep their defaults
        suggested.update(report["suggested_GEMV_CONFIGS"])
        paste = ", ".join(f"{k}: {v!r}" for k, v in suggested.items())
        report["paste"] = "GEMV_CONFIGS = {" + paste + "}"
    report["seconds"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=1), flush=True)
    save(report, args.output)


def save(report: dict[str, Any], path: str | None) -> None:
    """Written after every stage, so a run cut short still leaves what it measured."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
