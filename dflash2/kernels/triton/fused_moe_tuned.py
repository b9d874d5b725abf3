"""Tuned configs of the fused MoE GEMMs, written by benchmarks/moe_kernel_tune.py (rerun it rather than edit).

(E, N, K, bits, T bucket) -> config of the GEMM whose weights are [E, N, K]: gate_up is (E, 2I, H), down (E, H, I);
the T bucket is the power of two at or above the tokens (fused_moe_configs.token_bucket).
"""
from __future__ import annotations

TUNED_CONFIGS: dict[tuple[int, int, int, int, int], dict[str, int]] = {
}
