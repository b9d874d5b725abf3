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
        self._memo: tuple | None = None  # (positions, dtype, cos rows, sin rows): _rows

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D]; positions [T]. On CUDA q and k are rotated in place."""
        if q.is_cuda:
            from dflash2.kernels.triton.elementwise import rotary_in_place

            rotary_in_place(q, k, self.cos, self.sin, positions)
            return q, k
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated (a new tensor; the CPU path)."""
        cos, sin = self._rows(positions, x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, D] for positions. Every layer of a forward passes the same positions tensor, so the
        rows are looked up once a forward (held with the tensor, so its identity stays its own; the model's
        forward calls new_forward(), which drops them, as a buffer may be refilled in place between forwards)."""
        if self._memo is None or self._memo[0] is not positions or self._memo[1] != dtype:
            self._memo = (positions, dtype, self.cos[positions].to(dtype)[:, None, :],
                          self.sin[positions].to(dtype)[:, None, :])
        return self._memo[2], self._memo[3]

    def new_forward(self) -> None:
        self._memo = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
