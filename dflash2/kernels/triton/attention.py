"""TritonAttention: paged KV write, split-K paged decode attention, and varlen paged prefill attention.

Cache layout (one layer): [num_pages, tokens_per_page, kv_heads, head_dim], any tokens_per_page.
Token t of a request in slot s lives in page page_table[s, t // tokens_per_page] at offset
t % tokens_per_page. Decode splits each sequence into NUM_SPLITS equal pieces (so one graph serves every
length), each program handling all query heads of one KV head; a second kernel merges the pieces by their
log-sum-exp. Prefill programs each take BLOCK_M queries of one head of one request's chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.attention_metadata import AttentionMetadata

PREFILL_BLOCK_M = 64
DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}  # best of benchmarks/tune_decode.py on H200


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, page_table, token_slots, positions,
                     stride_kt, stride_vt, stride_cache_page, stride_cache_token, stride_pt,
                     tokens_per_page, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(token_slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
    dest = page * stride_cache_page + (pos % tokens_per_page) * stride_cache_token
    cols = tl.arange(0, ROW_PAD)
    mask = cols < ROW
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    tl.store(k_cache + dest + cols, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dest + cols, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv_tile(k_cache, v_cache, page_table, slot, tokens, token_mask, d, kv_head, stride_pt,
                  stride_cache_page, stride_cache_token, stride_cache_head, tokens_per_page):
    """K and V [len(tokens), head_dim] of one KV head, gathered through the request's page-table row."""
    page = tl.load(page_table + slot * stride_pt + tokens // tokens_per_page, mask=token_mask, other=0)
    offs = page.to(tl.int64) * stride_cache_page + (tokens % tokens_per_page) * stride_cache_token \
        + kv_head * stride_cache_head
    k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
    v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
    return k, v


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache, v_cache, cos_ptr, sin_ptr, page_table, token_slots,
                            positions, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_cache_page, stride_cache_token, stride_cache_head, stride_pt, stride_cos,
                            tokens_per_page, num_heads, num_kv_heads,
                            HALF: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr):
    """One token: rotate q in place; rotate k and write it, and v, into the token's page slot."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
    dest = page * stride_cache_page + (pos % tokens_per_page) * stride_cache_token
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    hq = tl.arange(0, Q_HEADS_PAD)
    q_mask = (hq < num_heads)[:, None]
    q_offs = t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    q2 = tl.load(q_ptr + q_offs + HALF, mask=q_mask, other=0.0)
    c, s = cos.to(q1.dtype), sin.to(q1.dtype)
    tl.store(q_ptr + q_offs, q1 * c - q2 * s, mask=q_mask)
    tl.store(q_ptr + q_offs + HALF, q2 * c + q1 * s, mask=q_mask)
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (hk < num_kv_heads)[:, None]
    k_offs = t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0)
    k2 = tl.load(k_ptr + k_offs + HALF, mask=kv_mask, other=0.0)
    cache_offs = dest + hk[:, None] * stride_cache_head + d[None, :]
    out_ty = k_cache.dtype.element_ty
    tl.store(k_cache + cache_offs, (k1 * c - k2 * s).to(out_ty), mask=kv_mask)
    tl.store(k_cache + cache_offs + HALF, (k2 * c + k1 * s).to(out_ty), mask=kv_mask)
    v_offs = t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptr + v_offs + HALF, mask=kv_mask, other=0.0)
    tl.store(v_cache + cache_offs, v1.to(out_ty), mask=kv_mask)
    tl.store(v_cache + cache_offs + HALF, v2.to(out_ty), mask=kv_mask)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, page_table, slots, lengths, out_ptr, lse_ptr,
                         stride_qt, stride_qh, stride_cache_page, stride_cache_token, stride_cache_head, stride_pt,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         scale, tokens_per_page,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths + b)
    slot = tl.load(slots + b).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k, v = _load_kv_tile(k_cache, v_cache, page_table, slot, tokens, token_mask, d, kv_head, stride_pt,
                             stride_cache_page, stride_cache_token, stride_cache_head, tokens_per_page)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    empty = start >= length
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_i))
    out_offs = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + out_offs, out, mask=head_mask[:, None])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(partial_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    split_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    parts = tl.load(partial_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=split_mask[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["row_offset"])  # varies every step: no recompile per value class
def _prefill_kernel(q_ptr, k_cache, v_cache, page_table, out_ptr, query_starts, context_lens, seg_slots,
                    block_segments, block_starts,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cache_page, stride_cache_token, stride_cache_head, stride_pt,
                    scale, tokens_per_page, row_offset,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.load(block_segments + block)
    m_start = tl.load(block_starts + block)
    q_start = tl.load(query_starts + seg)
    q_len = tl.load(query_starts + seg + 1) - q_start
    context = tl.load(context_lens + seg)
    slot = tl.load(seg_slots + seg).to(tl.int64)
    kv_head = head // GROUP

    m = m_start + tl.arange(0, BLOCK_M)
    row_mask = m < q_len
    q_pos = context - q_len + m
    d = tl.arange(0, HEAD_DIM)
    rows = (row_offset + q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(context, context - q_len + m_start + BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        k, v = _load_kv_tile(k_cache, v_cache, page_table, slot, tokens, token_mask, d, kv_head, stride_pt,
                             stride_cache_page, stride_cache_token, stride_cache_head, tokens_per_page)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        allowed = (tokens[None, :] <= q_pos[:, None]) & token_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _precision(q: torch.Tensor) -> str:
    """Exact float32 dot products for float32 models (Triton would use tf32); bf16/fp16 ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             page_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(num_tokens, row), v.reshape(num_tokens, row)
    _write_kv_kernel[(num_tokens,)](
        k2, v2, k_cache, v_cache, page_table, token_slots, positions,
        k2.stride(0), v2.stride(0), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        k_cache.shape[1], ROW=row, ROW_PAD=triton.next_power_of_2(row))


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> None:
    """Rotate q in place and write rotated k and v into the pages (one launch instead of two)."""
    tokens, num_heads, dim = q.shape
    if tokens == 0:
        return
    num_kv_heads = k.shape[1]
    _rotary_write_kv_kernel[(tokens,)](
        q, k, v, k_cache, v_cache, cos, sin, meta.page_table, meta.token_slots, meta.positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.page_table.stride(0), cos.stride(0),
        k_cache.shape[1], num_heads, num_kv_heads, HALF=dim // 2,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads))


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough splits that batch * kv_heads * splits fills the GPU about twice: a power of two, at most 32
    (each value is a separately compiled kernel, so only six exist; graph capture compiles them all)."""
    wanted = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    return min(32, triton.next_power_of_2(wanted))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] over each request's first lengths[b] cached positions -> [B, H, D]."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    partial = torch.empty((batch, num_heads, num_splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    block_n = DECODE_CONFIG["BLOCK_N"] if dim <= 128 else 32
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, slots, lengths, partial, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        scale, k_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=_precision(q), num_warps=DECODE_CONFIG["num_warps"],
        num_stages=DECODE_CONFIG["num_stages"])
    _decode_merge_kernel[(batch, num_heads)](
        partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=dim, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, row_offset: int) -> None:
    """Every prefill chunk's queries (rows from `row_offset` on) attend causally over their pages."""
    num_blocks = meta.prefill_block_segments.shape[0]
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    _prefill_kernel[(num_blocks, num_heads)](
        q, k_cache, v_cache, meta.page_table, out, meta.prefill_query_starts, meta.prefill_context_lens,
        meta.prefill_slots, meta.prefill_block_segments, meta.prefill_block_starts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.page_table.stride(0),
        scale, k_cache.shape[1], row_offset,
        GROUP=group, HEAD_DIM=dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64, PRECISION=_precision(q),
        num_warps=4, num_stages=2)


class TritonAttention:
    name = "triton"
    supports_graphs = True
    prefill_block_m = PREFILL_BLOCK_M

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.num_sms = num_sms or 132
        self.graph_num_splits: int | None = None  # fixed while capturing a graph

    fuses_rotary = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.page_table, meta.token_slots, meta.positions)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
        """forward() for un-rotated q and k: the rotary embedding is applied while writing the cache."""
        rotary_write_kv(q, k, v, k_cache, v_cache, cos, sin, meta)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            splits = self.graph_num_splits or decode_num_splits(nd, k_cache.shape[2], self.num_sms)
            decode_attention(q[:nd], k_cache, v_cache, meta.page_table, meta.decode_slots, meta.decode_lengths,
                             scale, splits, out=out[:nd])
        if meta.prefills:
            prefill_attention(q, k_cache, v_cache, meta, scale, out, row_offset=nd)
        return out
