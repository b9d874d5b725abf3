"""Rotary position embedding (the rotate-half layout), with llama3 and linear frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from dflash2.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for every position up to `max_positions`; `forward` rotates q and k in place of copies."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D]; positions [T]. On CUDA q and k are rotated in place."""
        if q.is_cuda:
            from dflash2.kernels.triton.elementwise import rotary_in_place

            rotary_in_place(q, k, self.cos, self.sin, positions)
            return q, k
        rows = self.rows(positions, q.dtype)
        return rotate(q, rows), rotate(k, rows)

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, 1, D] for positions (the CPU path; `rotate` applies them)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def rotate(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D] rotated by RotaryEmbedding.rows (a new tensor)."""
    cos, sin = rows
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
