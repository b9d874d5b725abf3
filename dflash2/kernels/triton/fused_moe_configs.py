"""Configs of the fused MoE GEMMs (kernels/triton/fused_moe.py): a default by shape, and the tune's table.

A config: BLOCK_M rows of the sorted layout (moe_align.py) x BLOCK_N output columns a program, BLOCK_K weights
along K a step (4/6 bits: whole groups, or a power-of-two part of one), GROUP_M row blocks walked together over
the columns (neighbouring programs share weight tiles in L2), num_warps, num_stages. The two GEMMs share BLOCK_M
(the layout); the down GEMM may take its own other keys, under "down":

    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
     "down": {"BLOCK_N": 64, ...}}

The small path (fused_moe_small.py: a program a (token, slot) pair and BLOCK_N columns, no blocks of rows) takes
"SMALL": 1 and, a GEMM, BLOCK_N (any power of two), BLOCK_K, SPLIT_K (programs sharing a tile along K) and
num_warps (no num_stages: its loads feed no tl.dot, and Triton 3.6 pipelines none of them); the gate_up config's
SMALL picks the path for both GEMMs:

    {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "down": {"BLOCK_N": 32}}

The table (fused_moe_tuned.TUNED_CONFIGS) is keyed by one GEMM's weight shape [E, N, K], bits and a bucket of
tokens; a call takes each GEMM's entry at its bucket, else at the nearest tuned bucket below, else the default.
The path: the call's SMALL, else the gate_up entry's, else the default rule (small_by_default).
"""
from __future__ import annotations

import triton

from dflash2.kernels.triton.fused_moe_tuned import TUNED_CONFIGS

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
SMALL_KEYS = ("SMALL", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")
MAX_BUCKET = 4096
# Rows an expert gets on average (T k / E) -> BLOCK_M: decode and small batches waste little of a 16-row block (the
# MMA's smallest), and their GEMMs are bound by the weights' bytes; more rows, larger tiles that reuse each weight
# tile over more rows. Untuned starting points (no GPU measurement yet).
_SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
_MEDIUM = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 3}
_LARGE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
# The small path reads its expert's rows once a pair, where the blocks read each selected expert once: it is the
# default while pairs seldom share an expert (T k <= E) and few enough that the blocks are mostly padding (T k <=
# 32: decode of up to 4 tokens at top-8; the tune's SMALL entries decide past that). An untuned starting point for
# both GEMMs: at qwen3-30b-a3b's T = 1, 384 gate_up programs of 2 x 16 rows (gate, up) and 1,024 down programs,
# 128 and 72 registers (sm_90, Triton 3.6), 16 and 8 KB of loads in flight a program.
SMALL_MAX_PAIRS = 32
SMALL_DEFAULT = {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4}


def token_bucket(num_tokens: int) -> int:
    return min(MAX_BUCKET, triton.next_power_of_2(max(1, num_tokens)))


def default_config(num_experts: int, n: int, k: int, num_tokens: int, top_k: int) -> dict[str, int]:
    """The untuned config for a GEMM of weights [E, N, K]; BLOCK_N and BLOCK_K no larger than N and K need
    (16 at least: tl.dot's smallest)."""
    rows_per_expert = num_tokens * top_k / num_experts
    config = dict(_SMALL if rows_per_expert <= 16 else _MEDIUM if rows_per_expert <= 48 else _LARGE)
    config["BLOCK_N"] = max(16, min(config["BLOCK_N"], triton.next_power_of_2(n)))
    config["BLOCK_K"] = max(16, min(config["BLOCK_K"], triton.next_power_of_2(k)))
    return config


def tuned_config(num_experts: int, n: int, k: int, bits: int, num_tokens: int) -> dict[str, int] | None:
    """The table's entry at the bucket of num_tokens, else at the largest tuned bucket below it; None if none."""
    bucket = token_bucket(num_tokens)
    below = [key[4] for key in TUNED_CONFIGS if key[:4] == (num_experts, n, k, bits) and key[4] <= bucket]
    return dict(TUNED_CONFIGS[(num_experts, n, k, bits, max(below))]) if below else None


def small_by_default(num_experts: int, num_tokens: int, top_k: int) -> bool:
    num_pairs = num_tokens * top_k
    return num_pairs <= SMALL_MAX_PAIRS and num_pairs <= num_experts


def moe_config(num_experts: int, hidden: int, inter: int, bits: int, num_tokens: int, top_k: int,
               config: dict | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(gate_up config, down config) for one call: `config` (its missing keys from below), else the table's
    entries, else the defaults; the down GEMM takes the gate_up's BLOCK_M, or its SMALL."""
    given_down = {**(config or {}), **(config or {}).get("down", {})} if config else None
    gate_up_entry = tuned_config(num_experts, 2 * inter, hidden, bits, num_tokens)
    down_entry = tuned_config(num_experts, hidden, inter, bits, num_tokens)
    small = next((bool(source["SMALL"]) for source in (config, gate_up_entry) if source and "SMALL" in source),
                 small_by_default(num_experts, num_tokens, top_k))
    if small:
        return _small(gate_up_entry, config), _small(down_entry, given_down)

    def pick(n: int, k: int, entry: dict | None, given: dict | None) -> dict[str, int]:
        base = entry if entry and not entry.get("SMALL") else default_config(num_experts, n, k, num_tokens, top_k)
        return {**base, **{key: value for key, value in (given or {}).items() if key in KEYS}}

    gate_up = pick(2 * inter, hidden, gate_up_entry, config)
    down = pick(hidden, inter, down_entry, given_down)
    down["BLOCK_M"] = gate_up["BLOCK_M"]
    return _checked(gate_up), _checked(down)


def _small(entry: dict | None, given: dict | None) -> dict[str, int]:
    """A small-path config: the given keys over the table's small entry (or SMALL_DEFAULT)."""
    base = entry if entry and entry.get("SMALL") else SMALL_DEFAULT
    config = {key: {**SMALL_DEFAULT, **base, **(given or {})}[key] for key in SMALL_KEYS}
    config["SMALL"] = 1
    tiles = [config[key] for key in ("BLOCK_N", "BLOCK_K")]
    if any(t & (t - 1) for t in tiles) or config["BLOCK_K"] < 16 or min(config[k] for k in SMALL_KEYS[1:]) < 1:
        raise ValueError(f"a small-path fused MoE config needs BLOCK_N and BLOCK_K powers of two (BLOCK_K >= 16), "
                         f"SPLIT_K and num_warps >= 1; got {config}")
    return config


def _checked(config: dict[str, int]) -> dict[str, int]:
    """Tiles of powers of two from 16 (tl.dot's smallest) and positive launch settings."""
    tiles = [config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
    if any(t < 16 or t & (t - 1) for t in tiles) or min(config[k] for k in KEYS[3:]) < 1:
        raise ValueError(f"a fused MoE config needs BLOCK_M/N/K powers of two >= 16, GROUP_M, num_warps and "
                         f"num_stages >= 1; got {config}")
    return config
