"""Tuned configs of the fused MoE GEMMs, written by benchmarks/moe_kernel_tune.py (rerun it rather than edit).

(E, N, K, bits, T bucket) -> config of the GEMM whose weights are [E, N, K]: gate_up is (E, 2I, H), down (E, H, I);
the T bucket is the power of two at or above the tokens (fused_moe_configs.token_bucket).
"""
from __future__ import annotations

TUNED_CONFIGS: dict[tuple[int, int, int, int, int], dict[str, int]] = {
    # qwen3-30b-a3b gate_up, T 1: the call 31.62 us (default 32.24)
    (128, 1536, 2048, 4, 1): {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 2: the call 47.32 us (default 58.49)
    (128, 1536, 2048, 4, 2): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b gate_up, T 4: the call 76.72 us (default 107.13)
    (128, 1536, 2048, 4, 4): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b gate_up, T 8: the call 117.49 us (default 117.61)
    (128, 1536, 2048, 4, 8): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b gate_up, T 16: the call 175.62 us (default 180.7)
    (128, 1536, 2048, 4, 16): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b gate_up, T 64: the call 279.53 us (default 279.53)
    (128, 1536, 2048, 4, 64): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 256: the call 402.61 us (default 402.61)
    (128, 1536, 2048, 4, 256): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 1024: the call 546.58 us (default 546.58)
    (128, 1536, 2048, 4, 1024): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 4096: the call 1462.62 us (default 1485.55)
    (128, 1536, 2048, 4, 4096): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 1: the call 31.39 us (default 32.91)
    (128, 1536, 2048, 16, 1): {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 2: the call 56.76 us (default 57.17)
    (128, 1536, 2048, 16, 2): {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 4: the call 98.3 us (default 100.92)
    (128, 1536, 2048, 16, 4): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 8: the call 171.54 us (default 200.22)
    (128, 1536, 2048, 16, 8): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 16: the call 280.49 us (default 307.97)
    (128, 1536, 2048, 16, 16): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b gate_up, T 64: the call 476.73 us (default 476.73)
    (128, 1536, 2048, 16, 64): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 256: the call 535.09 us (default 673.84)
    (128, 1536, 2048, 16, 256): {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 1024: the call 573.16 us (default 573.16)
    (128, 1536, 2048, 16, 1024): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b gate_up, T 4096: the call 1334.2 us (default 1344.79)
    (128, 1536, 2048, 16, 4096): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 1: the call 31.62 us (default 32.24)
    (128, 2048, 768, 4, 1): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4},
    # qwen3-30b-a3b down, T 2: the call 47.32 us (default 58.49)
    (128, 2048, 768, 4, 2): {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 8, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b down, T 4: the call 76.72 us (default 107.13)
    (128, 2048, 768, 4, 4): {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b down, T 8: the call 117.49 us (default 117.61)
    (128, 2048, 768, 4, 8): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b down, T 16: the call 175.62 us (default 180.7)
    (128, 2048, 768, 4, 16): {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SMALL": 0},
    # qwen3-30b-a3b down, T 64: the call 279.53 us (default 279.53)
    (128, 2048, 768, 4, 64): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 256: the call 402.61 us (default 402.61)
    (128, 2048, 768, 4, 256): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 1024: the call 546.58 us (default 546.58)
    (128, 2048, 768, 4, 1024): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 4096: the call 1462.62 us (default 1485.55)
    (128, 2048, 768, 4, 4096): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 1: the call 31.39 us (default 32.91)
    (128, 2048, 768, 16, 1): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8},
    # qwen3-30b-a3b down, T 2: the call 56.76 us (default 57.17)
    (128, 2048, 768, 16, 2): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8},
    # qwen3-30b-a3b down, T 4: the call 98.3 us (default 100.92)
    (128, 2048, 768, 16, 4): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b down, T 8: the call 171.54 us (default 200.22)
    (128, 2048, 768, 16, 8): {"SMALL": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b down, T 16: the call 280.49 us (default 307.97)
    (128, 2048, 768, 16, 16): {"SMALL": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4},
    # qwen3-30b-a3b down, T 64: the call 476.73 us (default 476.73)
    (128, 2048, 768, 16, 64): {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 256: the call 535.09 us (default 673.84)
    (128, 2048, 768, 16, 256): {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 1024: the call 573.16 us (default 573.16)
    (128, 2048, 768, 16, 1024): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    # qwen3-30b-a3b down, T 4096: the call 1334.2 us (default 1344.79)
    (128, 2048, 768, 16, 4096): {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
}
