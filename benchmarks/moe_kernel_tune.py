"""Tune the fused MoE GEMMs (kernels/triton/fused_moe.py) on the GPU: per model's expert shape, bit width and
bucket of tokens, time candidate configs of the whole fused_moe call and write the best into the config table
(kernels/triton/fused_moe_tuned.py, or --table). Prints one JSON line per measurement, then a summary.

    PYTHONPATH=$PWD python3 benchmarks/moe_kernel_tune.py [--models qwen3-30b-a3b,olmoe] [--tokens 1,16,256] \
        [--bits 16,4] [--budget-s 1200] [--output tune.json] [--table path.py] [--no-write]
    TRITON_INTERPRET=1 python3 benchmarks/moe_kernel_tune.py --cpu-smoke     (CPU: a tiny shape, two configs a phase)

Two phases per case: (1) configs shared by both GEMMs (BLOCK_M from the rows an expert gets; the default first, then
the table's current entries), (2) the down GEMM's own BLOCK_N / BLOCK_K / warps / stages at the winner's BLOCK_M;
phase 1 stops at PHASE_1_SHARE of the case's budget. The gate_up entry (E, 2I, H, bits, bucket) takes
phase 1's winner, the down entry (E, H, I, bits, bucket) phase 2's. Up to SMALL_TUNE_MAX_PAIRS (token, slot) pairs
the small path (fused_moe_small.py) competes too: phase 1 also times its configs ("SMALL": 1, with BLOCK_N /
BLOCK_K / SPLIT_K / warps), the blocks' configs carry "SMALL": 0, and phase 2 varies the winner's path;
so the table's entry at a bucket says which path its calls take. A config whose output is more than 1% off the
default config's is dropped (a fast wrong config must not win). Timing as in gemv_bench.py: one CUDA graph of
many calls, cycling through ROUTINGS random routings so that the experts read are mostly cold in L2.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable

if "--cpu-smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

import torch  # noqa: E402

from benchmarks import gemv_bench  # noqa: E402
from benchmarks.common import print_tune  # noqa: E402
from dflash2.kernels.triton import fused_moe_tuned  # noqa: E402
from dflash2.kernels.triton.fused_moe import fused_moe  # noqa: E402
from dflash2.kernels.triton.fused_moe_configs import (KEYS, SMALL_DEFAULT, SMALL_KEYS, default_config,  # noqa: E402
                                                       small_by_default, token_bucket, tuned_config)

MODELS = {  # E, k, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "olmoe": (64, 8, 2048, 1024),
}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
GROUP_SIZE = 128  # int4 / int6 (--cpu-smoke: 32)
ROUTINGS = 8
TILES = [(32, 128), (64, 64), (64, 128), (128, 64), (128, 128), (32, 256)]  # BLOCK_N, BLOCK_K
WARPS_STAGES = [(4, 3), (4, 4), (8, 3), (4, 2)]
# the small path: searched up to this many pairs (qwen3 / olmoe: 16 tokens), a program's rows x columns of K
SMALL_TUNE_MAX_PAIRS = 128
SMALL_TILES = [(16, 256), (32, 256), (16, 512), (8, 512), (32, 128)]
SMALL_DOWN_TILES = [(32, 256), (16, 256), (64, 256), (32, 128), (64, 128), (16, 512)]
SPLITS = (1, 2, 4)
SMALL_WARPS = (4, 8)
PHASE_1_SHARE = 2 / 3  # of a case's budget: phase 2 keeps the rest


def block_ms(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 8:
        return [16]
    if rows_per_expert <= 32:
        return [16, 32]
    if rows_per_expert <= 128:
        return [32, 64, 16]
    return [64, 128, 32]


def small_searched(num_tokens: int, top_k: int) -> bool:
    """Whether the small path competes for this many tokens (its pairs up to SMALL_TUNE_MAX_PAIRS)."""
    return num_tokens * top_k <= SMALL_TUNE_MAX_PAIRS


def shared_configs(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """Phase 1's candidates (the default for the shape goes first, from tune_case): the blocks' configs, and up to
    SMALL_TUNE_MAX_PAIRS pairs the small path's, those first where it is the default."""
    rows = num_tokens * top_k / num_experts
    group_ms = [1] if rows <= 16 else [8, 1]
    searched = small_searched(num_tokens, top_k)
    blocks = [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "num_warps": w, "num_stages": s,
               **({"SMALL": 0} if searched else {})}
              for m, (n, k), (w, s), g in itertools.product(block_ms(rows), TILES, WARPS_STAGES, group_ms)]
    if not searched:
        return blocks
    small = [{"SMALL": 1, **config} for config in small_configs(SMALL_TILES)]
    return small + blocks if small_by_default(num_experts, num_tokens, top_k) else blocks + small


def small_configs(tiles: list[tuple[int, int]]) -> list[dict[str, int]]:
    """The small path's keys of one GEMM over `tiles`, SPLITS and SMALL_WARPS, a tile's splits together."""
    return [{"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split, "num_warps": w}
            for w, (n, k), split in itertools.product(SMALL_WARPS, tiles, SPLITS)]


def down_configs(small: bool) -> list[dict[str, int]]:
    """Phase 2's candidates: the down GEMM's own tiles (BLOCK_M is the layout's, shared; the path the gate_up's)."""
    if small:
        return small_configs(SMALL_DOWN_TILES)
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s} for (n, k), (w, s)
            in itertools.product(TILES, WARPS_STAGES)]


def default_candidate(num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int) -> dict[str, Any]:
    """The config a call takes with no table: the small path's default, or the blocks' default for the gate_up
    shape (with "SMALL": 0 where the small path is searched too)."""
    if small_by_default(num_experts, num_tokens, top_k):
        return dict(SMALL_DEFAULT)
    searched = small_searched(num_tokens, top_k)
    return {**default_config(num_experts, 2 * inter, hidden, num_tokens, top_k), **({"SMALL": 0} if searched else {})}


def table_candidate(num_experts: int, top_k: int, hidden: int, inter: int, bits: int, num_tokens: int
                    ) -> dict[str, Any] | None:
    """The table's entries for the case (the last tune's winner, at this bucket or below) as one call's config, so
    that it competes again; None without one. An entry without SMALL is the blocks'."""
    gate_up = tuned_config(num_experts, 2 * inter, hidden, bits, num_tokens)
    if gate_up is None:
        return None
    small = bool(gate_up.get("SMALL"))
    keys = SMALL_KEYS if small else KEYS
    config = {key: gate_up[key] for key in keys if key in gate_up}
    if small or small_searched(num_tokens, top_k):
        config["SMALL"] = int(small)
    down = tuned_config(num_experts, hidden, inter, bits, num_tokens) or {}
    if bool(down.get("SMALL")) == small:
        config["down"] = {key: down[key] for key in keys if key in down and key not in ("SMALL", "BLOCK_M")}
    return config


def random_experts(bits: int, num_experts: int, n: int, k: int, device: str, dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
    """Random weights [E, n, k] in a format (codes and plausible scales: the speed does not depend on them)."""
    if bits == 16:
        return {"w": (torch.randn(num_experts, n, k, device=device) * 0.02).to(dtype)}
    packed_k = {8: k, 4: k // 2, 6: k * 3 // 4}[bits]
    w = torch.randint(-127 if bits == 8 else 0, 128 if bits == 8 else 256, (num_experts, n, packed_k),
                      device=device, dtype=torch.int32).to(torch.int8 if bits == 8 else torch.uint8)
    if bits == 8:
        return {"w": w, "scales": torch.rand(num_experts, n, device=device).half() * 1e-3}
    groups = k // GROUP_SIZE
    zero = 7.5 if bits == 4 else 31.5
    return {"w": w, "scales": torch.rand(num_experts, n, groups, device=device).half() * 1e-2,
            "zeros": torch.full((num_experts, n, groups), zero, device=device, dtype=torch.float16)}


def moe_call(model: tuple[int, int, int, int], bits: int, num_tokens: int, device: str, dtype: torch.dtype
             ) -> tuple[Callable[[int, dict | None], torch.Tensor], int]:
    """fn(routing index, config) -> fused_moe's output on one of ROUTINGS random routings; and the bytes of
    weights a call reads at most (every expert, or k experts a token)."""
    num_experts, top_k, hidden, inter = model
    gate_up = random_experts(bits, num_experts, 2 * inter, hidden, device, dtype)
    down = random_experts(bits, num_experts, hidden, inter, device, dtype)
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    routings = []
    for _ in range(ROUTINGS):
        weights, ids = torch.topk(torch.randn(num_tokens, num_experts, device=device).softmax(-1), top_k)
        routings.append((weights / weights.sum(-1, keepdim=True), ids))
    extra: dict[str, Any] = {"bits": bits}
    if bits != 16:
        extra.update(gate_up_scales=gate_up["scales"], down_scales=down["scales"])
    if bits in (4, 6):
        extra.update(group_size=GROUP_SIZE, gate_up_zeros=gate_up["zeros"], down_zeros=down["zeros"])

    def call(index: int, config: dict | None) -> torch.Tensor:
        weights, ids = routings[index]
        return fused_moe(x, gate_up["w"], down["w"], weights, ids, config=config, **extra)

    experts_read = min(num_experts, num_tokens * top_k)
    nbytes = sum(t.numel() * t.element_size() for t in (*gate_up.values(), *down.values()))
    return call, nbytes * experts_read // num_experts


def timed(call: Callable[[int, dict | None], torch.Tensor], config: dict | None) -> tuple[float, torch.Tensor]:
    """(seconds a call, the output on the first routing): the CUDA-graph timing of gemv_bench over the routings;
    on the CPU (--cpu-smoke) the one call."""
    started = time.perf_counter()
    out = call(0, config)  # on the GPU: compiles, outside the graph
    if gemv_bench.DEVICE != "cuda":
        return time.perf_counter() - started, out
    calls = gemv_bench.cycle(lambda index: call(index, config), list(range(ROUTINGS)))
    return gemv_bench.seconds_per_call(calls), out


def measure(case: dict[str, Any], call: Callable, config: dict, expected: torch.Tensor, nbytes: int
            ) -> dict[str, Any] | None:
    """One config's row (printed), or None where it does not compile or is wrong."""
    try:
        seconds, got = timed(call, config)
    except Exception as e:  # registers, shared memory
        print(json.dumps({**case, "config": config, "error": str(e)[:120]}), flush=True)
        return None
    error = float((got.float() - expected).norm() / expected.norm().clamp_min(1e-30))
    row = {**case, "config": config, "us": round(seconds * 1e6, 2), "GB_s": round(nbytes / seconds / 1e9, 1),
           "rel_error": round(error, 5)}
    print(json.dumps({**row, **({"error": "wrong result"} if not error < 1e-2 else {})}), flush=True)
    return row if error < 1e-2 else None


def tune_case(name: str, bits: int, num_tokens: int, device: str, dtype: torch.dtype, budget_s: float,
              limit: int | None) -> tuple[list[dict], dict[str, Any] | None]:
    """(every row, the case's result: the winners of both phases and the default's time)."""
    num_experts, top_k, hidden, inter = model = MODELS[name]
    case = {"model": name, "bits": bits, "T": num_tokens}
    call, nbytes = moe_call(model, bits, num_tokens, device, dtype)
    default = default_candidate(num_experts, top_k, hidden, inter, num_tokens)
    expected = call(0, None).float()
    started = time.time()
    deadline = started + budget_s
    rows = []
    table = table_candidate(num_experts, top_k, hidden, inter, bits, num_tokens)
    candidates = [default] + ([table] if table and table != default else [])
    candidates += [c for c in shared_configs(num_experts, top_k, num_tokens) if c not in candidates]
    for config in candidates[:limit]:
        if time.time() > started + PHASE_1_SHARE * budget_s:
            break
        row = measure({**case, "phase": "shared"}, call, config, expected, nbytes)
        rows += [row] if row else []
    if not rows:
        return rows, None
    best = min(rows, key=lambda r: r["us"])
    shared = {key: value for key, value in best["config"].items() if key != "down"}
    best_down = best
    for down in down_configs(bool(shared.get("SMALL")))[:limit]:
        if time.time() > deadline:
            break
        row = measure({**case, "phase": "down"}, call, {**shared, "down": down}, expected, nbytes)
        if row:
            rows.append(row)
            best_down = row if row["us"] < best_down["us"] else best_down
    down = {**shared, **best_down["config"].get("down", {})}
    result = {**case, "us": best_down["us"], "default_us": rows[0]["us"] if rows[0]["config"] == default else None,
              "gate_up": {"key": [num_experts, 2 * inter, hidden, bits, token_bucket(num_tokens)], "config": shared},
              "down": {"key": [num_experts, hidden, inter, bits, token_bucket(num_tokens)], "config": down}}
    return rows, result


# -- the table -------------------------------------------------------------------------------------------
_ENTRY = re.compile(r"^    (\(\d+, \d+, \d+, \d+, \d+\)): ")


def write_table(path: str, results: list[dict[str, Any]]) -> None:
    """Merge the winners into the table file at `path` (fused_moe_tuned.py's layout): an entry a line, sorted,
    after a comment with the time against the default's; entries of other shapes stay as they were."""
    entries: dict[tuple[int, ...], list[str]] = {}
    if os.path.exists(path):
        with open(path) as f:
            comment: list[str] = []
            for line in f.read().splitlines():
                match = _ENTRY.match(line)
                if match:
                    entries[tuple(int(v) for v in match.group(1)[1:-1].split(", "))] = comment + [line]
                comment = [line] if line.startswith("    # ") else []
    for result in results:
        default = f" (default {result['default_us']})" if result["default_us"] else ""
        for gemm in ("gate_up", "down"):
            key = tuple(result[gemm]["key"])
            entries[key] = [f"    # {result['model']} {gemm}, T {result['T']}: the call {result['us']} us{default}",
                            f"    {key}: {json.dumps(result[gemm]['config'])},"]
    with open(fused_moe_tuned.__file__) as f:
        text = f.read()
    body = "".join(line + "\n" for key in sorted(entries) for line in entries[key])
    with open(path, "w") as f:
        f.write(text[:text.index("TUNED_CONFIGS")] + "TUNED_CONFIGS: dict[tuple[int, int, int, int, int], "
                "dict[str, int]] = {\n" + body + "}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    parser.add_argument("--bits", default="16,8,4", help="comma-separated, of 16, 8, 6, 4")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="the whole tune's time, shared by the cases")
    parser.add_argument("--output", default=None, help="every row and the summary as JSON")
    parser.add_argument("--table", default=fused_moe_tuned.__file__, help="the config table to merge into")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="on the CPU under TRITON_INTERPRET=1: a tiny shape, two configs, a temporary table")
    args = parser.parse_args(argv)
    device, dtype, limit = "cuda", torch.bfloat16, None
    models, tokens, bits_list = args.models.split(","), [int(t) for t in args.tokens.split(",")], args.bits
    if args.cpu_smoke:
        gemv_bench.DEVICE, device, dtype, limit = "cpu", "cpu", torch.float32, 2
        MODELS["tiny"] = (4, 2, 64, 32)
        global GROUP_SIZE
        GROUP_SIZE = 32
        models, tokens = ["tiny"], [1, 3]  # the small path's default, then the blocks'
        if args.table == fused_moe_tuned.__file__:  # never the real table
            args.table = os.path.join(tempfile.mkdtemp(), "fused_moe_tuned.py")
    cases = [(m, int(b), t) for m in models for b in bits_list.split(",") for t in tokens]
    rows, results = [], []
    for name, bits, num_tokens in cases:
        case_rows, result = tune_case(name, bits, num_tokens, device, dtype, args.budget_s / len(cases), limit)
        rows += case_rows
        results += [result] if result else []
        if device == "cuda":
            torch.cuda.empty_cache()
    print_tune(rows, {"cases": results, "table": None if args.no_write else args.table}, args.output)
    if not args.no_write and results:
        write_table(args.table, results)


if __name__ == "__main__":
    main()
