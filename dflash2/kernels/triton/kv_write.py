"""Writing new K/V into the paged cache (TritonAttention's first half): one program a token, quantizing to the
cache's kind (int8 / int4 / fp8 with an fp16 scale per token and head, absmax / qmax, round half up).

    write_kv          K and V as they are
    rotary_write_kv   the rotary embedding applied to q in place and to k on its way into the cache (and
                      Qwen3's per-head q/k RMS norms first, `qk_norm`): one launch instead of three

Both read the token's slot, position and page (the host copies them in before the step's first kernel) and
the rotary tables before their programmatic-dependent-launch wait (pdl.py): only q, k and v come from the
kernel before.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache, kv_kind
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

# KV kinds as kernel constants (KVCache.kind): a float cache, or one quantized format with fp16 row scales
KIND_IDS = {"float": 0, "int8": 1, "int4": 2, "fp8": 3}
@triton.jit
def _row_scales(absmax, KIND: tl.constexpr):
    """fp16 scale of each row from its absolute maximum: absmax / qmax (kv_quant.py is the reference)."""
    if KIND == 1:
        qmax = 127.0
    elif KIND == 2:
        qmax = 7.0
    else:
        qmax = 448.0
    return tl.minimum(absmax / qmax, 65504.0).to(tl.float16)



@triton.jit
def _store_rows(cache, row_offs, x, inv_scale, mask, COL0: tl.constexpr, WIDTH: tl.constexpr, KIND: tl.constexpr):
    """Store x [R, WIDTH] (values COL0.. of each row) at cache + row_offs[r]; quantized kinds divide by
    `inv_scale` [R] (the row scale, 1 where it is 0) and round first. int4 packs pairs into bytes."""
    if KIND == 0:
        cols = COL0 + tl.arange(0, WIDTH)
        tl.store(cache + row_offs[:, None] + cols[None, :], x.to(cache.dtype.element_ty), mask=mask[:, None])
    else:
        scaled = x.to(tl.float32) / inv_scale[:, None]
        if KIND == 3:
            cols = COL0 + tl.arange(0, WIDTH)
            tl.store(cache + row_offs[:, None] + cols[None, :],
                     tl.clamp(scaled, -448.0, 448.0).to(cache.dtype.element_ty), mask=mask[:, None])
        elif KIND == 1:
            cols = COL0 + tl.arange(0, WIDTH)
            q = tl.clamp(tl.floor(scaled + 0.5), -127.0, 127.0)
            tl.store(cache + row_offs[:, None] + cols[None, :], q.to(tl.int8), mask=mask[:, None])
        else:
            q = tl.clamp(tl.floor(scaled + 0.5), -7.0, 7.0).to(tl.int32) + 8
            lo, hi = tl.split(tl.reshape(q, [q.shape[0], WIDTH // 2, 2]))
            cols = COL0 // 2 + tl.arange(0, WIDTH // 2)
            tl.store(cache + row_offs[:, None] + cols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=mask[:, None])



@triton.jit
def _store_scales(scales, scale_offs, absmax, mask, KIND: tl.constexpr):
    """Write each row's fp16 scale; returns the divisor for _store_rows (the scale, or 1 for a zero row)."""
    s = _row_scales(absmax, KIND)
    tl.store(scales + scale_offs, s, mask=mask)
    sf = s.to(tl.float32)
    return tl.where(sf == 0.0, 1.0, sf)



@triton.jit
def _token_rows(page_table, token_slots, positions, t, heads, stride_pt, tokens_per_page,
                stride_cache_page, stride_cache_token, stride_cache_head,
                stride_scale_page, stride_scale_token, stride_scale_head):
    """Token t's position, and its rows in its page (one a KV head in `heads`): value and scale offsets."""
    slot = tl.load(token_slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
    in_page = pos % tokens_per_page
    return (pos, page * stride_cache_page + in_page * stride_cache_token + heads * stride_cache_head,
            page * stride_scale_page + in_page * stride_scale_token + heads * stride_scale_head)


@triton.jit
def _row_divisors(k_scales, v_scales, scale_offs, k_absmax, v_absmax, mask, HEADS_PAD: tl.constexpr,
                  KIND: tl.constexpr):
    """For a quantized cache, store the K and V row scales and return what to divide the rows by; 1 for a float
    cache."""
    k_div = tl.full([HEADS_PAD], 1.0, tl.float32)
    v_div = k_div
    if KIND != 0:
        k_div = _store_scales(k_scales, scale_offs, k_absmax, mask, KIND)
        v_div = _store_scales(v_scales, scale_offs, v_absmax, mask, KIND)
    return k_div, v_div


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, page_table, token_slots, positions,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_page, stride_cache_token,
                     stride_cache_head, stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                     tokens_per_page, num_kv_heads,
                     HEAD_DIM: tl.constexpr, KV_HEADS_PAD: tl.constexpr, KIND: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One token: its K and V rows (every KV head) into the token's page slot, quantized for KIND > 0."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PAD)
    mask = heads < num_kv_heads
    _, row_offs, scale_offs = _token_rows(page_table, token_slots, positions, t, heads, stride_pt, tokens_per_page,
                                          stride_cache_page, stride_cache_token, stride_cache_head,
                                          stride_scale_page, stride_scale_token, stride_scale_head)
    pdl_start(USE_PDL)  # after the host-written indices (module docstring)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask[:, None], other=0.0)
    k_div, v_div = _row_divisors(k_scales, v_scales, scale_offs, tl.max(tl.abs(k.to(tl.float32)), 1),
                                 tl.max(tl.abs(v.to(tl.float32)), 1), mask, KV_HEADS_PAD, KIND)
    _store_rows(k_cache, row_offs, k, k_div, mask, 0, HEAD_DIM, KIND)
    _store_rows(v_cache, row_offs, v, v_div, mask, 0, HEAD_DIM, KIND)


@triton.jit
def _rms_norm_halves(x1, x2, weight_ptr, eps, HALF: tl.constexpr):
    """Per-row RMSNorm of rows given as halves [R, HALF] x2: float32 statistics over the whole row, the
    weight applied in the input dtype (elementwise._head_rms_norm's arithmetic)."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
    d = tl.arange(0, HALF)
    w1 = tl.load(weight_ptr + d)[None, :]
    w2 = tl.load(weight_ptr + HALF + d)[None, :]
    return w1 * (a * inv).to(x1.dtype), w2 * (b * inv).to(x2.dtype)


@triton.jit
def _rotated_halves(x1, x2, c, s):
    """Rotate-half rotary of rows given as halves, c and s in their dtype, each result rounded to it (as a
    separate rotary kernel would store it)."""
    return (x1 * c - x2 * s).to(x1.dtype), (x2 * c + x1 * s).to(x1.dtype)


@triton.jit
def _rotated_rows(x, x_swapped, c, s, first_half):
    """_rotated_halves on whole rows: x_swapped is x with its halves exchanged, c and s the tables repeated
    over both halves, first_half marks the first half's columns; the same operations, so the same roundings."""
    c, s = c.to(x.dtype), s.to(x.dtype)
    return tl.where(first_half, x * c - x_swapped * s, x * c + x_swapped * s).to(x.dtype)


@triton.jit(do_not_specialize=["first_row"])  # the step's decode rows: no recompile per value class
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, cos_ptr, sin_ptr,
                            page_table, token_slots, positions, q_norm_w, k_norm_w, norm_eps, first_row,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_cache_page, stride_cache_token, stride_cache_head,
                            stride_scale_page, stride_scale_token, stride_scale_head, stride_pt, stride_cos,
                            tokens_per_page, num_heads, num_kv_heads,
                            HALF: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                            KIND: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: rotate q in place; rotate k and write it, and v, into the token's page slot. QK_NORM
    (Qwen3): q and k are RMS-normed per head first, as elementwise.qk_rms_norm_ would (one launch fewer).
    Program i takes row first_row + i: the rows are not sliced on the host, whose pointers' 16-byte alignment
    (int32 slots, int64 positions past an odd decode count) Triton would compile a variant for."""
    t = first_row + tl.program_id(0).to(tl.int64)
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = hk < num_kv_heads
    pos, row_offs, scale_offs = _token_rows(page_table, token_slots, positions, t, hk, stride_pt, tokens_per_page,
                                            stride_cache_page, stride_cache_token, stride_cache_head,
                                            stride_scale_page, stride_scale_token, stride_scale_head)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    pdl_start(USE_PDL)  # after the host-written indices and the tables (module docstring)
    hq = tl.arange(0, Q_HEADS_PAD)
    q_mask = (hq < num_heads)[:, None]
    q_offs = t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    q2 = tl.load(q_ptr + q_offs + HALF, mask=q_mask, other=0.0)
    if QK_NORM:
        q1, q2 = _rms_norm_halves(q1, q2, q_norm_w, norm_eps, HALF)
    c, s = cos.to(q1.dtype), sin.to(q1.dtype)
    q1, q2 = _rotated_halves(q1, q2, c, s)
    tl.store(q_ptr + q_offs, q1, mask=q_mask)
    tl.store(q_ptr + q_offs + HALF, q2, mask=q_mask)
    k_offs = t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(k_ptr + k_offs, mask=kv_mask[:, None], other=0.0)
    k2 = tl.load(k_ptr + k_offs + HALF, mask=kv_mask[:, None], other=0.0)
    if QK_NORM:
        k1, k2 = _rms_norm_halves(k1, k2, k_norm_w, norm_eps, HALF)
    k1, k2 = _rotated_halves(k1, k2, c, s)
    v_offs = t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(v_ptr + v_offs, mask=kv_mask[:, None], other=0.0)
    v2 = tl.load(v_ptr + v_offs + HALF, mask=kv_mask[:, None], other=0.0)
    k_abs = tl.maximum(tl.max(tl.abs(k1.to(tl.float32)), 1), tl.max(tl.abs(k2.to(tl.float32)), 1))
    v_abs = tl.maximum(tl.max(tl.abs(v1.to(tl.float32)), 1), tl.max(tl.abs(v2.to(tl.float32)), 1))
    k_div, v_div = _row_divisors(k_scales, v_scales, scale_offs, k_abs, v_abs, kv_mask, KV_HEADS_PAD, KIND)
    _store_rows(k_cache, row_offs, k1, k_div, kv_mask, 0, HALF, KIND)
    _store_rows(k_cache, row_offs, k2, k_div, kv_mask, HALF, HALF, KIND)
    _store_rows(v_cache, row_offs, v1, v_div, kv_mask, 0, HALF, KIND)
    _store_rows(v_cache, row_offs, v2, v_div, kv_mask, HALF, HALF, KIND)
def scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """(kind id, k scales, v scales, their three strides); a float cache passes the cache and zero strides."""
    kind = KIND_IDS[kv_kind(k_cache.dtype)]
    if kind == 0:
        return kind, k_cache, k_cache, 0, 0, 0
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {kv_kind(k_cache.dtype)} KV cache needs its scale views")
    return (kind, k_scale, v_scale, *k_scale.stride())
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    num_tokens, num_kv_heads, dim = k.shape
    if num_tokens == 0:
        return
    kind, k_scales, v_scales, *scale_strides = scale_args(k_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scales, v_scales, page_table, token_slots, positions,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *scale_strides,
        page_table.stride(0), k_cache.shape[1], num_kv_heads,
        HEAD_DIM=dim, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), KIND=kind, **pdl_args())


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, first_row: int = 0) -> None:
    """Rotate q in place and write rotated k and v into the pages (one launch instead of two); with
    `qk_norm` = (q weight, k weight, eps), q and k are RMS-normed per head first (Qwen3). Rows from
    `first_row` on only (the decode rows before it are left to decode attention: attention.DECODE_ROTARY)."""
    tokens, num_heads, dim = q.shape
    if tokens <= first_row:
        return
    num_kv_heads = k.shape[1]
    kind, k_scales, v_scales, *scale_strides = scale_args(cache.k, cache.k_scale, cache.v_scale)
    q_norm_w, k_norm_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    _rotary_write_kv_kernel[(tokens - first_row,)](
        q, k, v, cache.k, cache.v, k_scales, v_scales, cos, sin, meta.page_table, meta.token_slots, meta.positions,
        q_norm_w, k_norm_w, eps, first_row,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache.k.stride()[:3], *scale_strides, meta.page_table.stride(0), cos.stride(0),
        cache.k.shape[1], num_heads, num_kv_heads, HALF=dim // 2,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        KIND=kind, QK_NORM=qk_norm is not None, **pdl_args())
