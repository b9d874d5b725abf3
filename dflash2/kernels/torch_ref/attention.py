"""TorchAttention: paged attention in plain PyTorch (the CPU backend and the tests' reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.kernels.attention_metadata import AttentionMetadata


class TorchAttention:
    name = "torch"
    supports_graphs = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D]; caches [num_pages, tokens_per_page, KVH, D]. Returns [T, H, D]."""
        write_kv(k, v, k_cache, v_cache, meta.page_table, meta.token_slots, meta.positions)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.page_table, meta.decode_slots,
                                        meta.decode_lengths, meta.max_decode_length, scale)
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            if seg.context_len == seg.query_len:  # nothing cached before this chunk: use the new K/V as is
                keys, values = k[rows], v[rows]
            else:
                keys = gather_pages(k_cache, meta.page_table[seg.slot], seg.context_len)
                values = gather_pages(v_cache, meta.page_table[seg.slot], seg.context_len)
            out[rows] = prefill_attention(q[rows], keys, values, scale)
        return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    tokens_per_page = k_cache.shape[1]
    pages = page_table[token_slots.long(), positions // tokens_per_page].long()
    offsets = positions % tokens_per_page
    k_cache[pages, offsets] = k.to(k_cache.dtype)
    v_cache[pages, offsets] = v.to(v_cache.dtype)


def gather_pages(cache: torch.Tensor, page_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens of one request's pages, as [num_tokens, KVH, D]."""
    num_pages = -(-num_tokens // cache.shape[1])
    return cache[page_row[:num_pages].long()].flatten(0, 1)[:num_tokens]


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over len(keys) positions. q [Q, H, D] -> [Q, H, D]."""
    num_q, num_k = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    kh, vh = kh.to(q.dtype), vh.to(q.dtype)
    if num_q == num_k:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        offset = num_k - num_q
        allowed = torch.arange(num_k, device=q.device)[None, :] <= torch.arange(num_q, device=q.device)[:, None] + offset
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, max_length: int, scale: float) -> torch.Tensor:
    """One query per request over its pages. q [B, H, D] -> [B, H, D]."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tokens_per_page = k_cache.shape[1]
    num_pages = -(-max_length // tokens_per_page)
    table = page_table[slots.long(), :num_pages].long()
    keys = k_cache[table].view(batch, num_pages * tokens_per_page, num_kv_heads, dim).to(q.dtype)
    values = v_cache[table].view(batch, num_pages * tokens_per_page, num_kv_heads, dim).to(q.dtype)
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    beyond = torch.arange(keys.shape[1], device=q.device)[None, :] >= lengths[:, None]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, KVH, G, D]
    return out.reshape(batch, num_heads, dim)
