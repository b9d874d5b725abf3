"""Configs of the fused MoE GEMMs (kernels/triton/fused_moe.py): a default by shape, and the tune's table.

A config: BLOCK_M rows of the sorted layout (moe_align.py) x BLOCK_N output columns a program, BLOCK_K weights
along K a step (4/6 bits: whole groups, or a power-of-two part of one), GROUP_M row blocks walked together over
the columns (neighbouring programs share weight tiles in L2), num_warps, num_stages. The two GEMMs share BLOCK_M
(the layout); the down GEMM may take its own other keys, under "down":

    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
     "down": {"BLOCK_N": 64, ...}}

The table (fused_moe_tuned.TUNED_CONFIGS) is keyed by one GEMM's weight shape [E, N, K], bits and a bucket of
tokens; a call takes each GEMM's entry at its bucket, else at the nearest tuned bucket below, else the default.
"""
from __future__ import annotations

import triton

from dflash2.kernels.triton.fused_moe_tuned import TUNED_CONFIGS

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
MAX_BUCKET = 4096
# Rows an expert gets on average (T k / E) -> BLOCK_M: decode and small batches waste little of a 16-row block (the
# MMA's smallest), and their GEMMs are bound by the weights' bytes; more rows, larger tiles that reuse each weight
# tile over more rows. Untuned starting points (no GPU measurement yet).
_SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
_MEDIUM = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 3}
_LARGE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


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


def moe_config(num_experts: int, hidden: int, inter: int, bits: int, num_tokens: int, top_k: int,
               config: dict | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(gate_up config, down config) for one call: `config` (its missing keys from below), else the table's
    entries, else the defaults; the down GEMM takes the gate_up's BLOCK_M."""
    def pick(n: int, k: int, given: dict | None) -> dict[str, int]:
        base = tuned_config(num_experts, n, k, bits, num_tokens) or default_config(num_experts, n, k, num_tokens,
                                                                                   top_k)
        return {**base, **{key: value for key, value in (given or {}).items() if key in KEYS}}

    given_down = {**(config or {}), **(config or {}).get("down", {})} if config else None
    gate_up = pick(2 * inter, hidden, config)
    down = pick(hidden, inter, given_down)
    down["BLOCK_M"] = gate_up["BLOCK_M"]
    return _checked(gate_up), _checked(down)


def _checked(config: dict[str, int]) -> dict[str, int]:
    """Tiles of powers of two from 16 (tl.dot's smallest) and positive launch settings."""
    tiles = [config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
    if any(t < 16 or t & (t - 1) for t in tiles) or min(config[k] for k in KEYS[3:]) < 1:
        raise ValueError(f"a fused MoE config needs BLOCK_M/N/K powers of two >= 16, GROUP_M, num_warps and "
                         f"num_stages >= 1; got {config}")
    return config
