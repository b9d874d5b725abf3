"""TorchAttention: paged attention in plain PyTorch (the CPU backend and the tests' reference).

Reads any KVCache kind: a float cache is cast to the query dtype; a quantized one (int8, int4, fp8) is
dequantized page by page after the gather (kernels/torch_ref/kv_quant.py has the formats).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache, kv_kind
from dflash2.kernels.torch_ref.kv_quant import dequantize_kv, quantize_kv


class TorchAttention:
    name = "torch"
    supports_graphs = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D]; cache views [num_pages, tokens_per_page, KVH, D]. Returns [T, H, D]."""
        step = meta.step_values
        if "cache_rows" not in step:
            step["cache_rows"] = cache_rows(meta.page_table, meta.token_slots, meta.positions, cache.k.shape[1])
        write_kv(k, v, cache.k, cache.v, meta.page_table, meta.token_slots, meta.positions,
                 cache.k_scale, cache.v_scale, rows=step["cache_rows"])
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:  # decodes only: no prefill rows to fill in
            return decode_attention(q, cache.k, cache.v, meta.page_table, meta.decode_slots, meta.decode_lengths,
                                    meta.max_decode_length, scale, cache.k_scale, cache.v_scale, step)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(q[:nd], cache.k, cache.v, meta.page_table, meta.decode_slots,
                                        meta.decode_lengths, meta.max_decode_length, scale,
                                        cache.k_scale, cache.v_scale, step)
        # a chunk with nothing cached before it may use its new K/V as is, when they read back unchanged
        reads_back_exactly = cache.kind == "float" and cache.k.dtype == k.dtype
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            if seg.context_len == seg.query_len and reads_back_exactly:
                keys, values = k[rows], v[rows]
            else:
                table = meta.page_table[seg.slot]
                keys = gather_pages(cache.k, table, seg.context_len, cache.k_scale, q.dtype)
                values = gather_pages(cache.v, table, seg.context_len, cache.v_scale, q.dtype)
            out[rows] = prefill_attention(q[rows], keys, values, scale)
        return out


def cache_rows(page_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
               tokens_per_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset in it) of each token's K/V."""
    pages = page_table[token_slots.long(), positions // tokens_per_page].long()
    return pages, positions % tokens_per_page


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Each token's K and V into its page (`rows`: cache_rows', if the caller has them)."""
    pages, offsets = rows if rows is not None else cache_rows(page_table, token_slots, positions, k_cache.shape[1])
    kind = kv_kind(k_cache.dtype)
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if kind == "float":
            cache[pages, offsets] = x.to(cache.dtype)
        else:
            data, row_scales = quantize_kv(x, kind)
            cache[pages, offsets] = data
            scales[pages, offsets] = row_scales


def _dequantized(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    kind = kv_kind(data.dtype)
    return data.to(dtype) if kind == "float" else dequantize_kv(data, scales, kind, dtype)


def gather_pages(cache: torch.Tensor, page_row: torch.Tensor, num_tokens: int,
                 scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `num_tokens` tokens of one request's pages, as [num_tokens, KVH, D] (dequantized to
    `dtype`; default: the cache's own dtype, float caches only)."""
    num_pages = -(-num_tokens // cache.shape[1])
    pages = page_row[:num_pages].long()
    data = cache.index_select(0, pages).flatten(0, 1)[:num_tokens]
    row_scales = None if scales is None else scales.index_select(0, pages).flatten(0, 1)[:num_tokens]
    return _dequantized(data, row_scales, dtype or cache.dtype)


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
                     slots: torch.Tensor, lengths: torch.Tensor, max_length: int, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     step_values: dict | None = None) -> torch.Tensor:
    """One query per request over its pages. q [B, H, D] -> [B, H, D]. `step_values` (the metadata's): the
    pages and the mask, the same for every layer, are kept there by the first."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tokens_per_page = k_cache.shape[1]
    num_pages = -(-max_length // tokens_per_page)
    step = {} if step_values is None else step_values
    if "decode_pages" not in step:
        step["decode_pages"] = page_table[slots.long(), :num_pages].long().reshape(-1)
        allowed = torch.arange(num_pages * tokens_per_page, device=q.device)[None, :] < lengths[:, None]  # [B, L]
        step["decode_mask"] = allowed[:, None, None, :]
    pages = step["decode_pages"]

    def gathered(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        # index_select copies whole pages (rows of dim 0): about 3x faster on the CPU than cache[table]
        values = _dequantized(cache.index_select(0, pages), None if scales is None else scales.index_select(0, pages),
                              q.dtype)
        return values.reshape(batch, num_pages * tokens_per_page, num_kv_heads, dim)

    keys, values = gathered(k_cache, k_scale), gathered(v_cache, v_scale)  # [B, L, KVH, D]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=step["decode_mask"], scale=scale, enable_gqa=True)
    return out.reshape(batch, num_heads, dim)
