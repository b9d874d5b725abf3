"""A decode step's kernel chain on llama-3-8b shapes (W2: one sequence), with and without early weights
(kernels/triton/gemv_parts.py: each GEMV program asks for its weight before it waits for the kernel before it).

Per layer, as models/llama.py runs it on CUDA: rms_norm -> qkv GEMV -> rotary -> attention stand-in -> o_proj
GEMV -> rms_norm (+ residual) -> gate_up GEMV -> down GEMV (bf16: silu-mul fused in; int4: a silu_and_mul
kernel first), 32 layers, then rms_norm -> lm_head. The stand-in for attention is one launch of 32 programs
that spin for --gap-us with DRAM idle, as the split decode attention of a short context does, then copy q to
the attention output. Every kernel is Triton with PDL (sm_90), the whole step one CUDA graph timed with CUDA
events; the weights are random, LAYER_COPIES distinct layers cycled (each larger than L2, as in the model).

    PYTHONPATH=$PWD python3 benchmarks/decode_chain_bench.py [--weights int4,bf16] [--output chain.json]
    TRITON_INTERPRET=1 python3 benchmarks/decode_chain_bench.py --smoke     (CPU: tiny shapes, checks it runs)

Prints one JSON line per (weights, setting): chain_ms (the whole step, min over replays), per_layer_us, and
gemv_ms = chain_ms - the same chain without its GEMVs (what the GEMVs add to the step); then, per weights, the
best setting and each GEMV's gain from early weights alone (the others off). Leave DFLASH2_GEMV_EARLY unset:
it overrides the settings compared here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.kernels.triton.elementwise import rms_norm, rotary_in_place, silu_and_mul  # noqa: E402
from dflash2.kernels.triton.int4_gemv import int4_config, int4_gemv  # noqa: E402
from dflash2.kernels.triton.pdl import pdl_args, pdl_start  # noqa: E402

DIMS = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336, "vocab": 128256,
        "layers": 32}
LAYER_COPIES = 4
GEMVS = ("qkv", "o_proj", "gate_up", "down", "lm_head")
# early-weight settings compared (config keys of gemv_parts); bf16 has no register variant (16-bit GEMV: L2 only)
SETTINGS = {"off": {"EARLY_L2_MB": 0, "EARLY_REGS": 0}, "regs": {"EARLY_L2_MB": 0, "EARLY_REGS": 1},
            "l2_8": {"EARLY_L2_MB": 8, "EARLY_REGS": 0}, "l2_16": {"EARLY_L2_MB": 16, "EARLY_REGS": 0},
            "l2_32": {"EARLY_L2_MB": 32, "EARLY_REGS": 0}, "l2_48": {"EARLY_L2_MB": 48, "EARLY_REGS": 0},
            "l2_16+regs": {"EARLY_L2_MB": 16, "EARLY_REGS": 1}, "l2_32+regs": {"EARLY_L2_MB": 32, "EARLY_REGS": 1}}
DEVICE = "cuda"


@triton.jit
def _attention_stand_in(q_ptr, out_ptr, cycles, SPIN: tl.constexpr, HEAD_DIM: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Spin `cycles` SM clocks (no memory traffic), then copy head program_id of q to the output."""
    pdl_start(USE_PDL)
    if SPIN:
        start = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        now = start
        while now - start < cycles:
            now = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False,
                                            pack=1)
    offs = tl.program_id(0) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + offs, tl.load(q_ptr + offs))


def random_int4(n: int, k: int) -> dict[str, Any]:
    """An int4_gemv weight with random codes, scale 0.01 and zero 8 (speed does not depend on the values)."""
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (n, k // 8), dtype=torch.int32, device=DEVICE)
    scales = torch.full((n, k // 128), 0.01, dtype=torch.float16, device=DEVICE)
    zeros = torch.full((n, k // 128), 8.0, dtype=torch.float16, device=DEVICE)
    sz = torch.stack((scales.view(torch.int16), zeros.view(torch.int16)), dim=-1).view(torch.int32)
    return {"words": words, "sz": sz.reshape(n, -1).contiguous(), "group_size": 128, "n": n, "k": k}


def random_bf16(n: int, k: int) -> dict[str, Any]:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return {"bits": 16, "n": n, "k": k, "w": (torch.randn(n, k, device=DEVICE) * 0.02).to(dtype)}


def shapes() -> dict[str, tuple[int, int]]:
    d = DIMS
    qkv = (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"]
    return {"qkv": (qkv, d["hidden"]), "o_proj": (d["hidden"], d["heads"] * d["head_dim"]),
            "gate_up": (2 * d["intermediate"], d["hidden"]), "down": (d["hidden"], d["intermediate"]),
            "lm_head": (d["vocab"], d["hidden"])}


class Chain:
    """The step's buffers and weights for one weight kind; `step(early)` launches the whole chain, early
    mapping GEMV name -> gemv_parts config keys (None: no GEMVs at all)."""

    def __init__(self, weights: str) -> None:
        self.weights, d = weights, DIMS
        make = random_int4 if weights == "int4" else random_bf16
        self.layers = [{name: make(*shape) for name, shape in shapes().items() if name != "lm_head"}
                       for _ in range(LAYER_COPIES)]
        self.lm_head = make(*shapes()["lm_head"])
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
        self.hidden = torch.randn(1, d["hidden"], device=DEVICE, dtype=dtype)
        self.residual = torch.zeros_like(self.hidden)
        self.norm = torch.ones(d["hidden"], device=DEVICE, dtype=dtype)
        self.cos = torch.rand(256, d["head_dim"] // 2, device=DEVICE)
        self.sin = torch.rand(256, d["head_dim"] // 2, device=DEVICE)
        self.positions = torch.full((1,), 100, dtype=torch.int64, device=DEVICE)
        self.attn_out = torch.empty(1, d["heads"] * d["head_dim"], device=DEVICE, dtype=dtype)
        self.outs = {name: torch.empty(1, n, device=DEVICE, dtype=dtype) for name, (n, _) in shapes().items()}
        self.cycles = 0

    def gemv(self, name: str, weight: dict[str, Any], x: torch.Tensor, early: dict | None,
             silu_mul: bool = False) -> torch.Tensor:
        out = self.outs[name]
        if early is None:  # the chain without GEMVs: the next kernel reads whatever the buffer holds
            return out
        n, k = weight["n"], weight["k"]
        if self.weights == "int4":
            return int4_gemv(x, weight, out=out, silu_mul=silu_mul, config={**int4_config(n, k), **early[name]})
        return qm.gemv(x, weight, out=out, silu_mul=silu_mul, config={**qm.gemv_config(16, n, k), **early[name]})

    def step(self, early: dict[str, dict] | None) -> None:
        d = DIMS
        h = self.hidden
        for i in range(d["layers"]):
            w = self.layers[i % LAYER_COPIES]
            x = rms_norm(h, self.norm, 1e-5, self.residual)
            qkv = self.gemv("qkv", w["qkv"], x, early)
            q = qkv[:, :d["heads"] * d["head_dim"]].view(1, d["heads"], d["head_dim"])
            k = qkv[:, d["heads"] * d["head_dim"]:(d["heads"] + d["kv_heads"]) * d["head_dim"]]
            rotary_in_place(q, k.view(1, d["kv_heads"], d["head_dim"]), self.cos, self.sin, self.positions)
            _attention_stand_in[(d["heads"],)](qkv, self.attn_out, self.cycles, SPIN=DEVICE == "cuda",
                                               HEAD_DIM=d["head_dim"], num_warps=4, **pdl_args())
            h = self.gemv("o_proj", w["o_proj"], self.attn_out, early)
            x = rms_norm(h, self.norm, 1e-5, self.residual)
            gate_up = self.gemv("gate_up", w["gate_up"], x, early)
            if self.weights == "int4":
                h = self.gemv("down", w["down"], silu_and_mul(gate_up), early)
            else:
                h = self.gemv("down", w["down"], gate_up, early, silu_mul=True)
        self.gemv("lm_head", self.lm_head, rms_norm(h, self.norm, 1e-5, self.residual), early)


def time_ms(launch: Callable[[], None], replays: int) -> list[float]:
    """Capture `launch` in a CUDA graph (after an eager warm-up that compiles) and time each replay."""
    if DEVICE != "cuda":  # --smoke
        started = time.perf_counter()
        launch()
        return [(time.perf_counter() - started) * 1e3]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return times


def measure(chain: Chain, early: dict[str, dict] | None, replays: int) -> dict[str, float]:
    times = time_ms(lambda: chain.step(early), replays)
    return {"chain_ms": round(min(times), 4), "median_ms": round(statistics.median(times), 4)}


def calibrate_gap(chain: Chain, gap_us: float) -> dict[str, float]:
    """SM clocks for the stand-in to last about gap_us (timed as a chain of 64 launches of it alone; a guess
    at 1.98 GHz first, then rescaled once)."""
    if DEVICE != "cuda":
        return {"gap_us": 0.0}
    qkv, heads, dim = chain.outs["qkv"], DIMS["heads"], DIMS["head_dim"]

    def gaps() -> None:
        for _ in range(64):
            _attention_stand_in[(heads,)](qkv, chain.attn_out, chain.cycles, SPIN=True, HEAD_DIM=dim, num_warps=4,
                                          **pdl_args())

    chain.cycles = int(gap_us * 1980)
    for _ in range(2):
        measured_us = min(time_ms(gaps, 5)) * 1e3 / 64
        chain.cycles = max(0, int(chain.cycles * gap_us / max(measured_us, 1e-3)))
    measured_us = min(time_ms(gaps, 5)) * 1e3 / 64
    return {"gap_us": round(measured_us, 2), "gap_cycles": chain.cycles}


def run(weights: str, replays: int, gap_us: float, settings: list[str]) -> dict[str, Any]:
    chain = Chain(weights)
    report: dict[str, Any] = {"weights": weights, **calibrate_gap(chain, gap_us)}
    without = measure(chain, None, replays)
    report["no_gemv"] = without
    print(json.dumps({"weights": weights, "setting": "no GEMVs", **without, "gap_us": report["gap_us"]}), flush=True)
    results = {}
    for name in settings:
        row = measure(chain, {g: SETTINGS[name] for g in GEMVS}, replays)
        row["per_layer_us"] = round(row["chain_ms"] * 1e3 / DIMS["layers"], 2)
        row["gemv_ms"] = round(row["chain_ms"] - without["chain_ms"], 4)
        results[name] = row
        print(json.dumps({"weights": weights, "setting": name, **row}), flush=True)
    report["settings"] = results
    best = min(results, key=lambda s: results[s]["chain_ms"])
    report["best"] = best
    if best != "off" and "off" in results:  # each GEMV alone with the best setting, the others off
        alone = {}
        for gemv in GEMVS:
            early = {g: SETTINGS[best if g == gemv else "off"] for g in GEMVS}
            alone[gemv] = round(results["off"]["chain_ms"] - measure(chain, early, replays)["chain_ms"], 4)
        report["gain_ms_alone"] = alone
        print(json.dumps({"weights": weights, "best": best, "gain_ms_alone": alone}), flush=True)
    del chain
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=None)
    parser.add_argument("--weights", default="int4,bf16")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--gap-us", type=float, default=5.0, help="how long the attention stand-in spins")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        global DEVICE, LAYER_COPIES
        DEVICE, LAYER_COPIES = "cpu", 1
        DIMS.update(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=96, layers=2)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)",
                              "dims": DIMS, "layer_copies": LAYER_COPIES,
                              "env": {k: v for k, v in os.environ.items() if k.startswith("DFLASH2_")},
                              "settings": SETTINGS, "results": []}
    started = time.time()
    for weights in args.weights.split(","):
        settings = [s for s in args.settings.split(",") if weights == "int4" or "regs" not in s]
        report["results"].append(run(weights, args.replays, args.gap_us, settings))
    report["seconds"] = round(time.time() - started, 1)
    print(json.dumps(report), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
