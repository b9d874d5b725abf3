"""The int8-KV decode loops that _decode_split_kernel (attention.py) runs over a program's KV range.

    _int8_imma_t_tiles  16-bit models with head_dim >= 32: q quantized once per program as two int8 terms,
                        integer K.q^T dots on the stored bytes (tokens as the mma's M side, the GQA heads as N),
                        one token sub-tile a warp, each with its own online softmax; K scale x q factor on the
                        scores, V scale folded into the probabilities, V bytes -> fp16 without a scale
    _int8_decode_tiles  float32 models and head_dim < 32: each K/V tile dequantized in registers to fp16 (or
                        float32), then float dots
All convert bytes with inline PTX on the GPU (plain casts under the interpreter) and find pages with a
multiply-high instead of a division.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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
def _int8_scales(k_scales, v_scales, page_table, slot, tokens, end, tokens_per_page, magic, stride_pt,
                 stride_scale_page, stride_scale_token, scale_head_offs):
    """The K and V row scales of these tokens (0 past `end`)."""
    page, in_page = _int8_page_rows(page_table, slot, tokens, tokens < end, tokens_per_page, magic, stride_pt)
    scale_offs = page * stride_scale_page + in_page * stride_scale_token + scale_head_offs
    return (tl.load(k_scales + scale_offs, mask=tokens < end, other=0.0),
            tl.load(v_scales + scale_offs, mask=tokens < end, other=0.0))


@triton.jit
def _int8_rows_and_next_scales(k_scales, v_scales, page_table, slot, tokens, end, tokens_per_page, magic,
                               stride_pt, stride_cache_page, stride_cache_token, head_offs, stride_scale_page,
                               stride_scale_token, scale_head_offs, BLOCK_N: tl.constexpr):
    """Each token's row offset in the cache, and the scales of the tile after this one (loaded a tile ahead, so
    the loop never waits on a scale)."""
    page, in_page = _int8_page_rows(page_table, slot, tokens, tokens < end, tokens_per_page, magic, stride_pt)
    offs = page * stride_cache_page + in_page * stride_cache_token + head_offs
    next_k_scale, next_v_scale = _int8_scales(k_scales, v_scales, page_table, slot, tokens + BLOCK_N, end,
                                              tokens_per_page, magic, stride_pt, stride_scale_page,
                                              stride_scale_token, scale_head_offs)
    return offs, next_k_scale, next_v_scale


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
    k_scale, v_scale = _int8_scales(k_scales, v_scales, page_table, slot, start + cols, end, tokens_per_page, magic,
                                    stride_pt, stride_scale_page, stride_scale_token, scale_head_offs)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + cols
        token_mask = tokens < end
        offs, next_k_scale, next_v_scale = _int8_rows_and_next_scales(
            k_scales, v_scales, page_table, slot, tokens, end, tokens_per_page, magic, stride_pt, stride_cache_page,
            stride_cache_token, head_offs, stride_scale_page, stride_scale_token, scale_head_offs, BLOCK_N)
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=token_mask[:, None], other=0)
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
def _int8_v_fp16_biased(x):
    """int8 tile x -> fp16 x + 1152 (exact): _int8_v_fp16 without the subtraction, 0.75 instructions a value;
    the caller takes 1152 x (the probabilities' sum) off the accumulator."""
    if _PTX:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 u; xor.b32 u, $2, 0x80808080; "
            "prmt.b32 $0, u, 0x64646464, 0x5140; prmt.b32 $1, u, 0x64646464, 0x7362; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(tl.float16) + 1152.0
    return y


@triton.jit
def _int8_imma_t_tiles(q, k_cache, v_cache, k_scales, v_scales, page_table, slot, start, end, kv_head,
                     stride_pt, stride_cache_page, stride_cache_token, stride_cache_head,
                     stride_scale_page, stride_scale_token, stride_scale_head, tokens_per_page, scale,
                     GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr):
    """The imma loop transposed and split per warp: scores S^T = K q^T [tokens, heads] (the stored K bytes as the
    mma's M side, q's two int8 terms as N, which may be below the mma's 8: no 16-row padding), and O^T = V^T P^T
    [head_dim, heads]. The tile is SUB sub-tiles of BLOCK_N / SUB tokens, one batch of a 3-D dot each (Triton
    gives each warp its own batch when SUB = num_warps): each keeps its own online softmax (no reduction or
    layout change across warps in the loop), merged by their maxima after it. Masked tokens get a -inf score
    through the K scale's addend. Returns (m_i in natural-log units, l_i, acc [GROUP_PAD, HEAD_DIM])."""
    T: tl.constexpr = BLOCK_N // SUB
    magic = (4294967295 // (tokens_per_page + tl.zeros([], tl.int64))).to(tl.uint32)
    d = tl.arange(0, HEAD_DIM)
    cols = tl.reshape(tl.arange(0, BLOCK_N), [SUB, T])
    q_hi, q_lo, q_factor = _int8_quantize_q(q, scale)
    q_hi = tl.broadcast_to(tl.trans(q_hi)[None, :, :], [SUB, HEAD_DIM, GROUP_PAD])
    q_lo = tl.broadcast_to(tl.trans(q_lo)[None, :, :], [SUB, HEAD_DIM, GROUP_PAD])
    m_i = tl.full([SUB, GROUP_PAD], float("-inf"), tl.float32)
    l_part = tl.zeros([SUB, T, GROUP_PAD], tl.float32)
    acc = tl.zeros([SUB, HEAD_DIM, GROUP_PAD], tl.float32)
    ones = tl.full([SUB, 16, T], 1.0, tl.float16)
    p_sum = tl.zeros([SUB, 16, GROUP_PAD], tl.float32)
    head_offs = kv_head * stride_cache_head
    scale_head_offs = kv_head * stride_scale_head
    k_scale, v_scale = _int8_scales(k_scales, v_scales, page_table, slot, start + cols, end, tokens_per_page, magic,
                                    stride_pt, stride_scale_page, stride_scale_token, scale_head_offs)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + cols
        token_mask = tokens < end
        offs, next_k_scale, next_v_scale = _int8_rows_and_next_scales(
            k_scales, v_scales, page_table, slot, tokens, end, tokens_per_page, magic, stride_pt, stride_cache_page,
            stride_cache_token, head_offs, stride_scale_page, stride_scale_token, scale_head_offs, BLOCK_N)
        offs = offs[:, :, None] + d[None, None, :]
        k = tl.load(k_cache + offs, mask=token_mask[:, :, None], other=0)
        v = tl.load(v_cache + offs, mask=token_mask[:, :, None], other=0)
        s_int = tl.dot(k, q_hi, out_dtype=tl.int32) * 254 + tl.dot(k, q_lo, out_dtype=tl.int32)  # [SUB, T, G]
        bias = tl.where(token_mask, 0.0, float("-inf"))
        s = s_int.to(tl.float32) * (k_scale.to(tl.float32) * (1.0 / 254.0))[:, :, None] + bias[:, :, None]
        m_new = tl.maximum(m_i, tl.max(s, 1) * q_factor[None, :])
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a sub-tile with no token yet
        p = tl.exp2(s * q_factor[None, None, :] - m_ref[:, None, :])
        alpha = tl.exp2(m_i - m_ref)
        l_part = l_part * alpha[:, None, :] + p
        pv = (p * v_scale.to(tl.float32)[:, :, None]).to(tl.float16)
        acc = acc * alpha[:, None, :] + tl.dot(tl.permute(_int8_v_fp16_biased(v), (0, 2, 1)), pv)
        p_sum = p_sum * alpha[:, None, :] + tl.dot(ones, pv)  # every row: the sum of pv, exact products
        m_i = m_new
        k_scale, v_scale = next_k_scale, next_v_scale
    m = tl.max(m_i, 0)
    w = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])  # [SUB, G]
    l_i = tl.sum(tl.sum(l_part, 1) * w, 0)
    acc = acc - 1152.0 * tl.max(p_sum, 1)[:, None, :]  # the rows of p_sum are equal
    acc = tl.trans(tl.sum(acc * w[:, None, :], 0))
    return m * 0.6931471805599453, l_i, acc


def int8_path(q: torch.Tensor, config: dict) -> str:
    """The int8 decode loop: "imma_t" for 16-bit q with head_dim >= 32 (an int8 mma takes 32 values a step), else
    "legacy" (float32 models keep exact float32 dots); a decode config's "int8" key picks one (for the tests
    and benchmarks/tune_decode.py)."""
    if "int8" in config:
        return config["int8"]
    return "imma_t" if q.dtype != torch.float32 and q.shape[-1] >= 32 else "legacy"


def int8_sub_tiles(block_n: int, num_warps: int) -> int:
    """The imma_t loop's token sub-tiles: one a warp, of at least 16 tokens (the P V dot's k step)."""
    return max(1, min(num_warps, block_n // 16))
