"""TritonAttention: paged KV write, split-K paged decode attention, and varlen paged prefill attention.

Cache (one layer, KVCache): views [num_pages, tokens_per_page, kv_heads, head_dim] with any strides (the
layout is head-major by default, engine/kv/layout.py), any tokens_per_page. Token t of a request in slot s
lives in page page_table[s, t // tokens_per_page] at offset t % tokens_per_page. Quantized caches (int8,
int4 packed two a byte, fp8 e4m3) carry an fp16 scale per token and head: the write kernels quantize
(absmax / qmax, round half up), and `_load_kv_tile` hands the stored values and the scales to the
attention loops, which fold the K scale into the scores and the V scale into the probabilities, since a
per-token scale commutes with both dot products: no per-element dequantize multiply. int8 decode of 16-bit
models quantizes q once per program and takes integer q.K dots on the stored bytes (_int8_imma_tiles); the
legacy loop (float32 models, DFLASH2_INT8_DECODE=legacy) dequantizes each tile to fp16 (_int8_decode_tiles).
Decode splits each sequence into NUM_SPLITS equal pieces (so one graph serves every length), each
program handling all query heads of one KV head; the last program of a row and KV head to finish (a ticket
from a self-resetting counter) merges the pieces by their log-sum-exp, so decode is one launch (with one
split, the W1 case, the program writes the output itself). The grid's fastest axis is the KV head, so
programs start in batch-row order: the runner orders decode rows longest first, which keeps the longest
sequences off the tail of a batch of mixed lengths.
Prefill programs each take BLOCK_M queries of one head of one request's chunk.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache, kv_kind
from dflash2.kernels.triton.gemv_parts import split_counters
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

PREFILL_BLOCK_M = 64
DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2}  # best of benchmarks/tune_decode.py on H200
# per KV kind where tuning found better (benchmarks/tune_decode.py prints the dict to paste); else DECODE_CONFIG.
# W1 shapes on the H200 (results/tune_decode_kv_2026-11-29_s3.json): bf16 218.6 us a layer (4 warps: 224.8),
# int8 198.7 (BLOCK_N 32, 4 warps: 244.7), both with the legacy int8 loop
DECODE_CONFIGS: dict[str, dict[str, int]] = {"int8": {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}}
# int8 KV decode loop for 16-bit models (DFLASH2_INT8_DECODE): "imma" (integer q.K dot, _int8_imma_tiles) or
# "legacy" (K and V dequantized to fp16, _int8_decode_tiles; float32 models always take it). A config dict's
# "int8" key overrides it (benchmarks/tune_decode.py compares both).
INT8_DECODE = os.environ.get("DFLASH2_INT8_DECODE", "imma")


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
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, page_table, token_slots, positions,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_page, stride_cache_token,
                     stride_cache_head, stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                     tokens_per_page, num_kv_heads,
                     HEAD_DIM: tl.constexpr, KV_HEADS_PAD: tl.constexpr, KIND: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One token: its K and V rows (every KV head) into the token's page slot, quantized for KIND > 0."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PAD)
    mask = heads < num_kv_heads
    d = tl.arange(0, HEAD_DIM)
    row_offs = page * stride_cache_page + (pos % tokens_per_page) * stride_cache_token + heads * stride_cache_head
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask[:, None], other=0.0)
    k_div = tl.full([KV_HEADS_PAD], 1.0, tl.float32)
    v_div = k_div
    if KIND != 0:
        scale_offs = page * stride_scale_page + (pos % tokens_per_page) * stride_scale_token \
            + heads * stride_scale_head
        k_div = _store_scales(k_scales, scale_offs, tl.max(tl.abs(k.to(tl.float32)), 1), mask, KIND)
        v_div = _store_scales(v_scales, scale_offs, tl.max(tl.abs(v.to(tl.float32)), 1), mask, KIND)
    _store_rows(k_cache, row_offs, k, k_div, mask, 0, HEAD_DIM, KIND)
    _store_rows(v_cache, row_offs, v, v_div, mask, 0, HEAD_DIM, KIND)


@triton.jit
def _load_kv_tile(k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                  stride_cache_page, stride_cache_token, stride_cache_head,
                  stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page,
                  HEAD_DIM: tl.constexpr, KIND: tl.constexpr):
    """K and V [len(tokens), HEAD_DIM] of one KV head, gathered through the request's page-table row, with
    their row scales [len(tokens)] (ones for a float cache). Quantized tiles hold the stored integers / fp8
    values: the scales are applied by the caller to the scores and probabilities (they are per token, so
    they factor out of both dot products)."""
    page = tl.load(page_table + slot * stride_pt + tokens // tokens_per_page, mask=token_mask, other=0).to(tl.int64)
    in_page = tokens % tokens_per_page
    offs = page * stride_cache_page + in_page * stride_cache_token + kv_head * stride_cache_head
    if KIND == 2:
        j = tl.arange(0, HEAD_DIM // 2)
        kb = tl.load(k_cache + offs[:, None] + j[None, :], mask=token_mask[:, None], other=0).to(tl.int32)
        vb = tl.load(v_cache + offs[:, None] + j[None, :], mask=token_mask[:, None], other=0).to(tl.int32)
        k = tl.interleave((kb & 15) - 8, (kb >> 4) - 8)
        v = tl.interleave((vb & 15) - 8, (vb >> 4) - 8)
    else:
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0.0)
    if KIND == 0:
        k_scale = tl.full(tokens.shape, 1.0, tl.float32)
        v_scale = k_scale
    else:
        scale_offs = page * stride_scale_page + in_page * stride_scale_token + kv_head * stride_scale_head
        k_scale = tl.load(k_scales + scale_offs, mask=token_mask, other=0.0).to(tl.float32)
        v_scale = tl.load(v_scales + scale_offs, mask=token_mask, other=0.0).to(tl.float32)
    return k, v, k_scale, v_scale


@triton.jit
def _tile_scores(q, k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                 stride_cache_page, stride_cache_token, stride_cache_head,
                 stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, scale,
                 HEAD_DIM: tl.constexpr, KIND: tl.constexpr, PRECISION: tl.constexpr):
    """One KV tile for the online softmax: the scores q K^T * scale (K scales folded in), with the tile's
    V and V scales."""
    k, v, k_scale, v_scale = _load_kv_tile(
        k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
        stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
        stride_scale_head, tokens_per_page, HEAD_DIM, KIND)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if KIND != 0:
        s = s * k_scale[None, :]
    return s * scale, v, v_scale


@triton.jit
def _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND: tl.constexpr, PRECISION: tl.constexpr,
                    ROWS_MAY_BE_EMPTY: tl.constexpr):
    """One KV tile into the online softmax: masked scores s [R, N] (-inf where not attended), the tile's V
    [N, D] and V scales; returns the new (running max, denominator, accumulator). ROWS_MAY_BE_EMPTY: a row
    may have no attended token yet (causal prefill), so its max stays -inf and must not be subtracted."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROWS_MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KIND != 0:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


# int8 decode (KIND 1): inline PTX converts the cached bytes (the interpreter, which cannot run PTX, takes the
# plain Triton path computing the same values)
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _int8_page_rows(page_table, slot, tokens, token_mask, tokens_per_page, magic, stride_pt):
    """Page entry and in-page offset of each token. t // tokens_per_page is a multiply-high by magic =
    (2^32 - 1) // tokens_per_page, low by at most one for t < 2^31, and one correction: a few instructions a
    token instead of a 32-bit division."""
    page_idx = tl.umulhi(tokens.to(tl.uint32), magic).to(tl.int32)
    in_page = tokens - page_idx * tokens_per_page
    over = in_page >= tokens_per_page
    page_idx = tl.where(over, page_idx + 1, page_idx)
    in_page = tl.where(over, in_page - tokens_per_page, in_page)
    page = tl.load(page_table + slot * stride_pt + page_idx, mask=token_mask, other=0)
    return page.to(tl.int64), in_page


@triton.jit
def _int8_tile(x, row_scale, F32: tl.constexpr):
    """int8 tile x [R, C] times its fp16 row scales [R] -> fp16 [R, C] (the dequantized values, as an fp16 cache
    would hold them), or float32 [R, C] for F32 (float32 models). PTX: 4 bytes at a time, flip the sign bits
    (q + 128 in 0..255), place each byte under an fp16 exponent of 1024 (prmt: 1024 + q + 128, exact),
    subtract 1152, multiply by the scale: 1.75 instructions a value. Not pure on purpose: the compiler would
    otherwise move the conversion past the layout change to the dot operand (converting there, after
    byte-wise shared memory reads)."""
    if F32:
        y = x.to(tl.float32) * row_scale.to(tl.float32)[:, None]
    elif _PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 u, m, a, b; xor.b32 u, $2, 0x80808080; mov.b32 m, 0x64806480; "
            "prmt.b32 a, u, 0x64646464, 0x5140; prmt.b32 b, u, 0x64646464, 0x7362; "
            "sub.f16x2 a, a, m; sub.f16x2 b, b, m; mul.f16x2 $0, a, $3; mul.f16x2 $1, b, $4; }",
            "=r,=r,r,r,r", [x, tl.broadcast_to(row_scale[:, None], x.shape)], dtype=tl.float16, is_pure=False,
            pack=4)
    else:
        y = x.to(tl.float16) * row_scale[:, None]
    return y


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
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, cos_ptr, sin_ptr,
                            page_table, token_slots, positions, q_norm_w, k_norm_w, norm_eps,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_cache_page, stride_cache_token, stride_cache_head,
                            stride_scale_page, stride_scale_token, stride_scale_head, stride_pt, stride_cos,
                            tokens_per_page, num_heads, num_kv_heads,
                            HALF: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                            KIND: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: rotate q in place; rotate k and write it, and v, into the token's page slot. QK_NORM
    (Qwen3): q and k are RMS-normed per head first, as elementwise.qk_rms_norm_ would (one launch fewer)."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    slot = tl.load(token_slots + t).to(tl.int64)
    page = tl.load(page_table + slot * stride_pt + pos // tokens_per_page).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d)[None, :]
    hq = tl.arange(0, Q_HEADS_PAD)
    q_mask = (hq < num_heads)[:, None]
    q_offs = t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    q2 = tl.load(q_ptr + q_offs + HALF, mask=q_mask, other=0.0)
    if QK_NORM:
        q1, q2 = _rms_norm_halves(q1, q2, q_norm_w, norm_eps, HALF)
    c, s = cos.to(q1.dtype), sin.to(q1.dtype)
    tl.store(q_ptr + q_offs, q1 * c - q2 * s, mask=q_mask)
    tl.store(q_ptr + q_offs + HALF, q2 * c + q1 * s, mask=q_mask)
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = hk < num_kv_heads
    k_offs = t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(k_ptr + k_offs, mask=kv_mask[:, None], other=0.0)
    k2 = tl.load(k_ptr + k_offs + HALF, mask=kv_mask[:, None], other=0.0)
    if QK_NORM:
        k1, k2 = _rms_norm_halves(k1, k2, k_norm_w, norm_eps, HALF)
    k1, k2 = (k1 * c - k2 * s).to(k1.dtype), (k2 * c + k1 * s).to(k1.dtype)  # rounded as a separate rotary would
    v_offs = t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(v_ptr + v_offs, mask=kv_mask[:, None], other=0.0)
    v2 = tl.load(v_ptr + v_offs + HALF, mask=kv_mask[:, None], other=0.0)
    row_offs = page * stride_cache_page + (pos % tokens_per_page) * stride_cache_token + hk * stride_cache_head
    k_div = tl.full([KV_HEADS_PAD], 1.0, tl.float32)
    v_div = k_div
    if KIND != 0:
        scale_offs = page * stride_scale_page + (pos % tokens_per_page) * stride_scale_token + hk * stride_scale_head
        k_abs = tl.maximum(tl.max(tl.abs(k1.to(tl.float32)), 1), tl.max(tl.abs(k2.to(tl.float32)), 1))
        v_abs = tl.maximum(tl.max(tl.abs(v1.to(tl.float32)), 1), tl.max(tl.abs(v2.to(tl.float32)), 1))
        k_div = _store_scales(k_scales, scale_offs, k_abs, kv_mask, KIND)
        v_div = _store_scales(v_scales, scale_offs, v_abs, kv_mask, KIND)
    _store_rows(k_cache, row_offs, k1, k_div, kv_mask, 0, HALF, KIND)
    _store_rows(k_cache, row_offs, k2, k_div, kv_mask, HALF, HALF, KIND)
    _store_rows(v_cache, row_offs, v1, v_div, kv_mask, 0, HALF, KIND)
    _store_rows(v_cache, row_offs, v2, v_div, kv_mask, HALF, HALF, KIND)


@triton.jit
def _int8_decode_tiles(q, m_i, acc, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head,
                       stride_pt, stride_cache_page, stride_cache_token, stride_cache_head,
                       stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, scale,
                       GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    """The decode loop over tokens start..end of an int8 cache: (m_i, l_i, acc) of the online softmax.
    Each K/V tile is dequantized in registers to fp16 (values x row scale, _int8_tile) and goes to the dots
    through shared memory as an fp16 tile would (ldmatrix, no byte-wise reads); q is cast to fp16 (clamped to
    its range) and both dots run in fp16 with fp32 accumulation (float32 models: float32 tiles and dots).
    The page entries are found once a token for K, V and the scales (no division a token), the scales of the
    next tile are loaded one iteration ahead (the compiler pipelines the K/V tiles and the page entries but not
    2-byte loads), and the softmax denominator is kept per score column and summed once after the loop (no
    cross-warp reduction a tile)."""
    magic = (4294967295 // (tokens_per_page + tl.zeros([], tl.int64))).to(tl.uint32)
    d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    F32: tl.constexpr = q.dtype == tl.float32
    if F32:
        q_dot = q
    else:
        q_dot = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    l_part = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    head_offs = kv_head * stride_cache_head
    scale_head_offs = kv_head * stride_scale_head
    tokens = start + cols
    page, in_page = _int8_page_rows(page_table, slot, tokens, tokens < end, tokens_per_page, magic, stride_pt)
    scale_offs = page * stride_scale_page + in_page * stride_scale_token + scale_head_offs
    k_scale = tl.load(k_scales + scale_offs, mask=tokens < end, other=0.0)
    v_scale = tl.load(v_scales + scale_offs, mask=tokens < end, other=0.0)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + cols
        token_mask = tokens < end
        page, in_page = _int8_page_rows(page_table, slot, tokens, token_mask, tokens_per_page, magic, stride_pt)
        offs = page * stride_cache_page + in_page * stride_cache_token + head_offs
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
        next_tokens = tokens + BLOCK_N
        next_mask = next_tokens < end
        page, in_page = _int8_page_rows(page_table, slot, next_tokens, next_mask, tokens_per_page, magic,
                                        stride_pt)
        scale_offs = page * stride_scale_page + in_page * stride_scale_token + scale_head_offs
        next_k_scale = tl.load(k_scales + scale_offs, mask=next_mask, other=0.0)
        next_v_scale = tl.load(v_scales + scale_offs, mask=next_mask, other=0.0)
        s = tl.dot(q_dot, tl.trans(_int8_tile(k, k_scale, F32)), input_precision=PRECISION) * scale
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_part = l_part * alpha[:, None] + p
        acc = acc * alpha[:, None] + tl.dot(p.to(q_dot.dtype), _int8_tile(v, v_scale, F32),
                                            input_precision=PRECISION)
        m_i = m_new
        k_scale, v_scale = next_k_scale, next_v_scale
    return m_i, tl.sum(l_part, 1), acc


@triton.jit
def _int8_quantize_q(q, scale):
    """q [R, D] as two int8 terms and a row factor: q ~ (hi + lo / 254) * qs (hi = round(q / qs), qs = absmax /
    127, lo the rounding remainder in 1/254 steps: ~15 bits, finer than bf16's 8), and qs * scale * log2(e)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    qs = tl.where(amax == 0.0, 1.0, amax / 127.0)
    x = qf / qs[:, None]
    hi = tl.clamp(tl.floor(x + 0.5), -127.0, 127.0)
    lo = tl.clamp(tl.floor((x - hi) * 254.0 + 0.5), -127.0, 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), qs * (scale * 1.4426950408889634)


@triton.jit
def _int8_v_fp16(x):
    """int8 tile x -> fp16 (exact). PTX: 4 bytes at a time, flip the sign bits (q + 128), place each byte under
    an fp16 exponent of 1024 (prmt), subtract 1152: 1.25 instructions a value (the V scale goes into the
    probabilities). Not pure on purpose (see _int8_tile)."""
    if _PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 u, m, a, b; xor.b32 u, $2, 0x80808080; mov.b32 m, 0x64806480; "
            "prmt.b32 a, u, 0x64646464, 0x5140; prmt.b32 b, u, 0x64646464, 0x7362; "
            "sub.f16x2 $0, a, m; sub.f16x2 $1, b, m; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _int8_imma_tiles(q, m_i, acc, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head,
                     stride_pt, stride_cache_page, stride_cache_token, stride_cache_head,
                     stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, scale,
                     GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The int8 decode loop without dequantizing K: q is quantized once (_int8_quantize_q) and the scores are
    two integer dots with the stored K bytes (int32, mma s8), times the K row scale and q's factor; the V row
    scale goes into the probabilities, and V is converted to fp16 without a scale (_int8_v_fp16) for an fp16
    dot. Scores are kept in log2 units (exp2); returns (m_i in natural-log units, l_i, acc) like
    _int8_decode_tiles."""
    magic = (4294967295 // (tokens_per_page + tl.zeros([], tl.int64))).to(tl.uint32)
    d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    q_hi, q_lo, q_factor = _int8_quantize_q(q, scale)
    m_i = m_i * 1.4426950408889634
    l_part = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    head_offs = kv_head * stride_cache_head
    scale_head_offs = kv_head * stride_scale_head
    tokens = start + cols
    page, in_page = _int8_page_rows(page_table, slot, tokens, tokens < end, tokens_per_page, magic, stride_pt)
    scale_offs = page * stride_scale_page + in_page * stride_scale_token + scale_head_offs
    k_scale = tl.load(k_scales + scale_offs, mask=tokens < end, other=0.0)
    v_scale = tl.load(v_scales + scale_offs, mask=tokens < end, other=0.0)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + cols
        token_mask = tokens < end
        page, in_page = _int8_page_rows(page_table, slot, tokens, token_mask, tokens_per_page, magic, stride_pt)
        offs = page * stride_cache_page + in_page * stride_cache_token + head_offs
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
        next_tokens = tokens + BLOCK_N
        next_mask = next_tokens < end
        page, in_page = _int8_page_rows(page_table, slot, next_tokens, next_mask, tokens_per_page, magic,
                                        stride_pt)
        scale_offs = page * stride_scale_page + in_page * stride_scale_token + scale_head_offs
        next_k_scale = tl.load(k_scales + scale_offs, mask=next_mask, other=0.0)
        next_v_scale = tl.load(v_scales + scale_offs, mask=next_mask, other=0.0)
        kt = tl.trans(k)
        s_int = tl.dot(q_hi, kt, out_dtype=tl.int32) * 254 + tl.dot(q_lo, kt, out_dtype=tl.int32)
        s = s_int.to(tl.float32) * (k_scale.to(tl.float32) * (1.0 / 254.0))[None, :]
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * q_factor)
        p = tl.exp2(s * q_factor[:, None] - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_part = l_part * alpha[:, None] + p
        pv = (p * v_scale.to(tl.float32)[None, :]).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(pv, _int8_v_fp16(v))
        m_i = m_new
        k_scale, v_scale = next_k_scale, next_v_scale
    return m_i * 0.6931471805599453, tl.sum(l_part, 1), acc


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, page_table, slots, lengths, out_ptr, lse_ptr,
                         final_ptr, cnt_ptr,
                         stride_qt, stride_qh, stride_cache_page, stride_cache_token, stride_cache_head,
                         stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                         scale, tokens_per_page,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr,
                         PRECISION: tl.constexpr, KIND: tl.constexpr, INT8_IMMA: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    # the KV head is the fastest grid axis: programs start in row order, all heads of a row together, so a
    # batch ordered longest-first (the runner's order) starts its longest programs first
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
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
    if KIND == 1 and INT8_IMMA:
        m_i, l_i, acc = _int8_imma_tiles(
            q, m_i, acc, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head, stride_pt,
            stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
            stride_scale_head, tokens_per_page, scale, GROUP_PAD, HEAD_DIM, BLOCK_N)
    elif KIND == 1:
        m_i, l_i, acc = _int8_decode_tiles(
            q, m_i, acc, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head, stride_pt,
            stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
            stride_scale_head, tokens_per_page, scale, GROUP_PAD, HEAD_DIM, BLOCK_N, PRECISION)
    else:
        for n0 in range(start, end, BLOCK_N):
            tokens = n0 + tl.arange(0, BLOCK_N)
            token_mask = tokens < end
            s, v, v_scale = _tile_scores(
                q, k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
                stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
                stride_scale_head, tokens_per_page, scale, HEAD_DIM, KIND, PRECISION)
            s = tl.where(token_mask[None, :], s, float("-inf"))
            m_i, l_i, acc = _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND, PRECISION, False)
    empty = start >= length
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_i))
    out_offs = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    if NUM_SPLITS > 1:  # one split: out_ptr is the final output and nothing is merged
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        counter = cnt_ptr + b * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1) == NUM_SPLITS - 1:  # the last split of this row and KV head merges
            _merge_splits(out_ptr, lse_ptr, final_ptr, b, kv_head * GROUP, length, per_split,
                          stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                          GROUP, GROUP_P2, HEAD_DIM, SPLITS_PAD)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_splits(partial_ptr, lse_ptr, out_ptr, b, first_head, length, per_split,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Combine the non-empty splits' partial outputs of the GROUP heads by their log-sum-exp, all heads in one
    [heads, splits, dim] tile so their loads go out together (read past L1: other SMs wrote them)."""
    g = tl.arange(0, GROUP_P2)[:, None]
    s = tl.arange(0, SPLITS_PAD)[None, :]
    used = (s < tl.cdiv(length, per_split)) & (g < GROUP)  # [heads, splits]
    heads = first_head + g
    lse = tl.load(lse_ptr + b * stride_lb + heads * stride_lh + s, mask=used, other=float("-inf"),
                  cache_modifier=".cg")
    w = tl.where(used, tl.exp(lse - tl.max(lse, 1)[:, None]), 0.0)
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    parts = tl.load(partial_ptr + b * stride_pb + heads[:, :, None] * stride_ph + s[:, :, None] * stride_ps + d,
                    mask=used[:, :, None], other=0.0, cache_modifier=".cg")
    merged = tl.sum(parts * w[:, :, None], 1) / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]  # [heads, dim]
    out_offs = b * stride_ob + (first_head + tl.arange(0, GROUP_P2))[:, None] * stride_oh + d.reshape(1, HEAD_DIM)
    tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=(tl.arange(0, GROUP_P2) < GROUP)[:, None])


@triton.jit(do_not_specialize=["row_offset"])  # varies every step: no recompile per value class
def _prefill_kernel(q_ptr, k_cache, v_cache, k_scales, v_scales, page_table, out_ptr, query_starts, context_lens,
                    seg_slots, block_segments, block_starts,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cache_page, stride_cache_token, stride_cache_head,
                    stride_scale_page, stride_scale_token, stride_scale_head, stride_pt,
                    scale, tokens_per_page, row_offset,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, KIND: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
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
        s, v, v_scale = _tile_scores(
            q, k_cache, v_cache, k_scales, v_scales, page_table, slot, tokens, token_mask, kv_head, stride_pt,
            stride_cache_page, stride_cache_token, stride_cache_head, stride_scale_page, stride_scale_token,
            stride_scale_head, tokens_per_page, scale, HEAD_DIM, KIND, PRECISION)
        allowed = (tokens[None, :] <= q_pos[:, None]) & token_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, v_scale, m_i, l_i, acc, q, KIND, PRECISION, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _precision(q: torch.Tensor) -> str:
    """Exact float32 dot products for float32 models (Triton would use tf32); bf16/fp16 ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
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
    kind, k_scales, v_scales, *scale_strides = _scale_args(k_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scales, v_scales, page_table, token_slots, positions,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *scale_strides,
        page_table.stride(0), k_cache.shape[1], num_kv_heads,
        HEAD_DIM=dim, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), KIND=kind, **pdl_args())


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """Rotate q in place and write rotated k and v into the pages (one launch instead of two); with
    `qk_norm` = (q weight, k weight, eps), q and k are RMS-normed per head first (Qwen3)."""
    tokens, num_heads, dim = q.shape
    if tokens == 0:
        return
    num_kv_heads = k.shape[1]
    kind, k_scales, v_scales, *scale_strides = _scale_args(cache.k, cache.k_scale, cache.v_scale)
    q_norm_w, k_norm_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    _rotary_write_kv_kernel[(tokens,)](
        q, k, v, cache.k, cache.v, k_scales, v_scales, cos, sin, meta.page_table, meta.token_slots, meta.positions,
        q_norm_w, k_norm_w, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache.k.stride()[:3], *scale_strides, meta.page_table.stride(0), cos.stride(0),
        cache.k.shape[1], num_heads, num_kv_heads, HALF=dim // 2,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        KIND=kind, QK_NORM=qk_norm is not None, **pdl_args())


# How many programs per SM the decode grid aims at (DFLASH2_DECODE_WAVES): more splits make smaller work units,
# which balance batches of mixed lengths better but add a merge (in the last split's program). W1 (256 rows x
# 8 KV heads) runs one split at any value up to 8.
DECODE_WAVES = int(os.environ.get("DFLASH2_DECODE_WAVES", "2"))


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132, group: int = 1) -> int:
    """Enough splits that batch * kv_heads * splits fills the GPU DECODE_WAVES times: a power of two, at most
    32, and at most MERGE_TILE / group (the last split merges [group, splits, head_dim] in registers). Each
    value is a separately compiled kernel, so only six exist; graph capture compiles them all."""
    wanted = triton.cdiv(DECODE_WAVES * num_sms, max(1, batch * num_kv_heads))
    return min(32, max(1, MERGE_TILE // triton.next_power_of_2(group)), triton.next_power_of_2(wanted))


MERGE_TILE = 64  # heads x splits the merging program holds at once (x head_dim fp32 values over its threads)


def _int8_path(q: torch.Tensor, config: dict) -> str:
    """The int8 decode loop: the config's "int8" key, else DFLASH2_INT8_DECODE for 16-bit q with head_dim >= 32
    (an int8 mma takes 32 values a step), else legacy (float32 models keep exact float32 dots)."""
    if "int8" in config:
        return config["int8"]
    return INT8_DECODE if q.dtype != torch.float32 and q.shape[-1] >= 32 else "legacy"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """q [B, H, D] over each request's first lengths[b] cached positions -> [B, H, D]. `config` overrides
    DECODE_CONFIG (benchmarks/tune_decode.py)."""
    batch, num_heads, dim = q.shape
    config = DECODE_CONFIGS.get(kv_kind(k_cache.dtype), DECODE_CONFIG) if config is None else config
    kind, k_scales, v_scales, *scale_strides = _scale_args(k_cache, k_scale, v_scale)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_splits == 1:  # the split kernel writes the output itself: no partials, no merge
        partial, lse = out.unsqueeze(2), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:  # the last split of each row and KV head merges them (a ticket from split_counters)
        partial = torch.empty((batch, num_heads, num_splits, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    counters = split_counters(q.device, batch * num_kv_heads)  # a dict lookup; read only with splits
    block_n = config["BLOCK_N"] if dim <= 128 else 32
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, k_scales, v_scales, page_table, slots, lengths, partial, lse, out, counters,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *scale_strides, page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), scale, k_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), GROUP_P2=triton.next_power_of_2(group),
        HEAD_DIM=dim, BLOCK_N=block_n, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        PRECISION=_precision(q), KIND=kind, INT8_IMMA=_int8_path(q, config) == "imma",
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_args())
    return out


def prefill_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, row_offset: int) -> None:
    """Every prefill chunk's queries (rows from `row_offset` on) attend causally over their pages."""
    num_blocks = meta.prefill_block_segments.shape[0]
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // cache.k.shape[2]
    kind, k_scales, v_scales, *scale_strides = _scale_args(cache.k, cache.k_scale, cache.v_scale)
    _prefill_kernel[(num_blocks, num_heads)](
        q, cache.k, cache.v, k_scales, v_scales, meta.page_table, out, meta.prefill_query_starts,
        meta.prefill_context_lens, meta.prefill_slots, meta.prefill_block_segments, meta.prefill_block_starts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache.k.stride()[:3], *scale_strides, meta.page_table.stride(0),
        scale, cache.k.shape[1], row_offset,
        GROUP=group, HEAD_DIM=dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64, PRECISION=_precision(q), KIND=kind,
        num_warps=4, num_stages=2, **pdl_args())


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, cache.k, cache.v, meta.page_table, meta.token_slots, meta.positions,
                 cache.k_scale, cache.v_scale)
        return self._attend(q, cache, meta, scale)

    def forward_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                       qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """forward() for un-rotated q and k: the rotary embedding (and Qwen3's q/k norms, `qk_norm`) is
        applied while writing the cache."""
        rotary_write_kv(q, k, v, cache, cos, sin, meta, qk_norm)
        return self._attend(q, cache, meta, scale)

    def _attend(self, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            num_kv_heads = cache.k.shape[2]
            splits = self.graph_num_splits or decode_num_splits(nd, num_kv_heads, self.num_sms,
                                                                q.shape[1] // num_kv_heads)
            decode_attention(q[:nd], cache.k, cache.v, meta.page_table, meta.decode_slots, meta.decode_lengths,
                             scale, splits, out=out[:nd], k_scale=cache.k_scale, v_scale=cache.v_scale)
        if meta.prefills:
            prefill_attention(q, cache, meta, scale, out, row_offset=nd)
        return out
