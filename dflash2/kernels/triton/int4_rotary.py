"""The rotary embedding and the KV write in the int4 qkv GEMV's epilogue (DFLASH2_QKV_ROTARY=1, off until measured
on a GPU): decode steps of a 16-bit cache and a model without q/k norms skip the rotary_write_kv launch.

The qkv weight's repacked rows are permuted within each head (pair_rotary_rows): permuted row 2i is the head's
row i, 2i + 1 its row i + D / 2, so that a program of BLOCK_N rows (BLOCK_N dividing D) holds BLOCK_N / 2 whole
rotary pairs of one head, as a gate_up program holds its (gate, up) pairs. The epilogue rounds the products to
the model's dtype (as the GEMV stores them), rotates the q and k pairs with rotary_write_kv's arithmetic, stores
q into the GEMV's output (its [q | k | v] columns, q's in their usual places) and k and v into the token's page
slot. Every other launch on a permuted weight stores its rows back in their usual columns (_unpermuted_cols).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash2.kernels.attention_metadata import RotaryWrite
from dflash2.kernels.triton.kv_write import _rotated_halves, _token_rows

# DFLASH2_QKV_ROTARY=1: qkv weights that can take it are paired for the epilogue (TritonWeight.pair_rotary)
QKV_ROTARY = os.environ.get("DFLASH2_QKV_ROTARY", "0") == "1"


def pair_rotary_rows(weight: dict, head_dim: int) -> dict:
    """A prepare_int4 weight with its rows permuted within each head (module docstring)."""
    n = weight["n"]
    if head_dim % 2 or n % head_dim:
        raise ValueError(f"rotary pairs need an even head size dividing the rows, got {head_dim} and {n}")
    j = torch.arange(head_dim)
    within = j // 2 + (j % 2) * (head_dim // 2)
    order = (torch.arange(n // head_dim)[:, None] * head_dim + within[None, :]).reshape(-1).to(weight["words"].device)
    return {**weight, "words": weight["words"][order].contiguous(), "sz": weight["sz"][order].contiguous(),
            "rotary_pairs": head_dim}


@triton.jit
def _unpermuted_cols(cols, N, HEAD_DIM: tl.constexpr):
    """Permuted row r -> its usual column (rows past N stay past N, masked)."""
    j = cols % HEAD_DIM
    return tl.where(cols < N, cols - j + j // 2 + (j % 2) * (HEAD_DIM // 2), cols)


@triton.jit
def _rotary_rows(tile, m_idx, M, cos_ptr, sin_ptr, stride_cos, positions, token_slots, page_table, stride_pt,
                 stride_cache_page, stride_cache_token, stride_cache_head, tokens_per_page, num_heads,
                 num_kv_heads, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Tile `tile`'s head (q heads, then k, then v), its pairs' first columns d [P] within the head, cos and sin
    [BM, P] at each row's position, and each row's offset in the cache for this head's KV head [BM]
    (kv_write._token_rows; rows past M read row M - 1's). Reads only what the host writes before the step and
    the tables, so it may come before the PDL wait."""
    head = (tile * BLOCK_N) // HEAD_DIM
    d = ((tile * BLOCK_N) % HEAD_DIM) // 2 + tl.arange(0, BLOCK_N // 2)
    kv_head = tl.maximum(head - num_heads, 0) % num_kv_heads
    pos, offs, _ = _token_rows(page_table, token_slots, positions, tl.minimum(m_idx, M - 1), kv_head, stride_pt,
                               tokens_per_page, stride_cache_page, stride_cache_token, stride_cache_head, 0, 0, 0)
    cos = tl.load(cos_ptr + pos[:, None] * stride_cos + d[None, :])
    sin = tl.load(sin_ptr + pos[:, None] * stride_cos + d[None, :])
    return head, d, cos, sin, offs


@triton.jit
def _rotary_store(result, head, d, cos, sin, cache_offs, out_ptr, k_cache, v_cache, m_idx, M, stride_om,
                  num_heads, num_kv_heads, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The tile's [BM, BN] products: q rotated into out, k rotated and v as they are into the cache."""
    dtype = out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    x1, x2 = tl.split(tl.reshape(result.to(dtype), [BLOCK_M, BLOCK_N // 2, 2]))  # columns d and d + HALF
    mask = (m_idx < M)[:, None]
    r1, r2 = _rotated_halves(x1, x2, cos.to(dtype), sin.to(dtype))  # rotary_write_kv's roundings
    if head < num_heads:
        q_ptrs = out_ptr + m_idx[:, None] * stride_om + head * HEAD_DIM + d[None, :]
        tl.store(q_ptrs, r1, mask=mask)
        tl.store(q_ptrs + HALF, r2, mask=mask)
    elif head < num_heads + num_kv_heads:
        k_ptrs = k_cache + cache_offs[:, None] + d[None, :]
        tl.store(k_ptrs, r1.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(k_ptrs + HALF, r2.to(k_cache.dtype.element_ty), mask=mask)
    else:
        v_ptrs = v_cache + cache_offs[:, None] + d[None, :]
        tl.store(v_ptrs, x1.to(v_cache.dtype.element_ty), mask=mask)
        tl.store(v_ptrs + HALF, x2.to(v_cache.dtype.element_ty), mask=mask)


def rotary_launch_args(rotary: RotaryWrite | None, out: torch.Tensor) -> dict:
    """The kernel's rotary arguments (pointers unused without ROTARY: `out` stands in)."""
    if rotary is None:
        return dict(cos_ptr=out, sin_ptr=out, stride_cos=0, positions=out, token_slots=out, page_table=out,
                    stride_pt=0, k_cache=out, v_cache=out, stride_cache_page=0, stride_cache_token=0,
                    stride_cache_head=0, tokens_per_page=1, num_heads=0, num_kv_heads=1)
    cache, meta = rotary.cache, rotary.meta
    return dict(cos_ptr=rotary.cos, sin_ptr=rotary.sin, stride_cos=rotary.cos.stride(0), positions=meta.positions,
                token_slots=meta.token_slots, page_table=meta.page_table, stride_pt=meta.page_table.stride(0),
                k_cache=cache.k, v_cache=cache.v, stride_cache_page=cache.k.stride(0),
                stride_cache_token=cache.k.stride(1), stride_cache_head=cache.k.stride(2),
                tokens_per_page=cache.k.shape[1], num_heads=rotary.num_heads, num_kv_heads=rotary.num_kv_heads)
