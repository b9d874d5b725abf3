"""The int4 decode GEMV's arithmetic (kernels: int4_gemv.py): the repacked layout, codes to floats, packed fp16
products, the activations and their RMSNorm.

At 4 bits a weight the bytes are so few that instructions, not bandwidth, limit a plain kernel: an H200
issues about 4 thread-instructions per weight at full bandwidth. This one spends about 3 (M = 1) with float32
products, as below, and about 2-2.5 with the packed fp16 products that 16-bit models use (HALF2, further down):

Layout (repacked once at prepare(); the on-disk tensor stays as it is). Each row is cut into chunks of 32
columns = 4 int32 words = one 16-byte vector a thread loads. Word j (0..3) of a chunk holds the 8 codes of
columns 4 p + j (p = 0..7), so the codes of nibble slot p across the 4 words meet the 4 contiguous
activations x[4 p : 4 p + 4] of the chunk (one 8-byte load, shared by all rows a thread holds).

Codes to floats, one LOP3 each (plus 3 shifts a word): slots sit in pairs of 8 contiguous bits; a pair is
brought to bits 15..22 (the word itself, >> 8, << 8, rotated by 16) and `(v & mask) | exponent` gives
    slot A (bits 19..22): 1.0f with q in the top mantissa bits   = 1 + q / 16
    slot B (bits 15..18): 16.0f with q right below                = 16 + q / 16
so every float is exact and q / 16 carries the same weight in both. Per chunk and row:
    F = sum f x = XA + 16 XB + (1 / 16) sum q x,      XA, XB = sums of x over the A / B slots
    sum (q - z) s x = s (16 F - 16 XA - 256 XB - z X)  with X = XA + XB,
where XA, XB and X depend on x only (computed once per chunk for all rows of a thread).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import _activation, _normed

CHUNK = 32  # columns a thread takes from a row per step (4 int32 words)
# bit offset of slot p (0..7) in its word; p even: B slots, p odd: A slots (see the docstring)
SLOT_BITS = (15, 19, 23, 27, 7, 11, 31, 3)
MASK_A, ONE_A = tl.constexpr(0x00780000), tl.constexpr(0x3F800000)  # bits 19..22 | 1.0f
MASK_B, ONE_B = tl.constexpr(0x00078000), tl.constexpr(0x41800000)  # bits 15..18 | 16.0f


def repack_int4(qweight: torch.Tensor, rows_at_once: int = 4096,
                slot_bits: tuple[int, ...] = SLOT_BITS) -> torch.Tensor:
    """On-disk int4 [N, K/2] u8 (byte i: codes 2i low, 2i + 1 high) -> [N, K/8] int32 in the layout above
    (rows_at_once rows at a time: the int64 temporaries take 16 bytes a weight); slot_bits: HALF2_SLOT_BITS for
    the half2 layout."""
    n, half = qweight.shape
    k = half * 2
    if k % CHUNK:
        raise ValueError(f"int4 GEMV needs K divisible by {CHUNK}, got {k}")
    out = torch.empty((n, k // 8), dtype=torch.int32, device=qweight.device)
    for r0 in range(0, n, rows_at_once):
        part = qweight[r0:r0 + rows_at_once]
        rows = part.shape[0]
        codes = torch.stack((part & 15, part >> 4), dim=-1).reshape(rows, k // CHUNK, 8, 4).to(torch.int64)
        words = torch.zeros((rows, k // CHUNK, 4), dtype=torch.int64, device=qweight.device)
        for p, bit in enumerate(slot_bits):  # codes[n, c, p, j] = q[32 c + 4 p + j] -> word j, slot p
            q = codes[:, :, p, :]
            words |= ((q << bit) | (q >> (32 - bit))) & 0xFFFFFFFF  # rotated left within 32 bits
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
        out[r0:r0 + rows] = words.reshape(rows, k // 8).to(torch.int32)
    return out


@triton.jit
def _slot_floats(w, ASM: tl.constexpr):
    """int32 words -> the 8 slot floats (B, A, B, A, ...), see the docstring. ASM: shifts and one LOP3 a
    slot in PTX (ptxas splits `(v & m) | c` into two instructions otherwise); the interpreter takes plain ops."""
    if ASM:
        f0, f1, f2, f3, f4, f5, f6, f7 = tl.inline_asm_elementwise(
            """{
            .reg .b32 v1, v2, v3;
            shr.b32 v1, $8, 8;
            shl.b32 v2, $8, 8;
            shf.l.wrap.b32 v3, $8, $8, 16;
            lop3.b32 $0, $8, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $1, $8, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $2, v1, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $3, v1, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $4, v2, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $5, v2, 0x00780000, 0x3F800000, 0xEA;
            lop3.b32 $6, v3, 0x00078000, 0x41800000, 0xEA;
            lop3.b32 $7, v3, 0x00780000, 0x3F800000, 0xEA;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        v1 = w >> 8
        v2 = w << 8
        v3 = ((w >> 16) & 0xFFFF) | (w << 16)
        f0, f1 = (w & MASK_B) | ONE_B, (w & MASK_A) | ONE_A
        f2, f3 = (v1 & MASK_B) | ONE_B, (v1 & MASK_A) | ONE_A
        f4, f5 = (v2 & MASK_B) | ONE_B, (v2 & MASK_A) | ONE_A
        f6, f7 = (v3 & MASK_B) | ONE_B, (v3 & MASK_A) | ONE_A
    return (f0.to(tl.float32, bitcast=True), f1.to(tl.float32, bitcast=True), f2.to(tl.float32, bitcast=True),
            f3.to(tl.float32, bitcast=True), f4.to(tl.float32, bitcast=True), f5.to(tl.float32, bitcast=True),
            f6.to(tl.float32, bitcast=True), f7.to(tl.float32, bitcast=True))


@triton.jit
def _bf16_pairs_to_float(v):
    """bf16 -> float32, two values a 32-bit register: one SHL / one LOP3 each (ptxas extracts the high half
    with a PRMT and then shifts it otherwise)."""
    return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }", "=r,=r,r", [v],
                                     dtype=tl.float32, is_pure=True, pack=2)


# half2 (16-bit activations; float32 models take the float products above): the same chunks and slots,
# but slot s of a word sits at bit HALF2_SLOT_BITS[s], so that one LOP3 with 0x64006400 makes two fp16 values
# 1024 + q (slots 0/1 of the word, and of the word >> 8: slots 4/5) or 1024 + 16 q (slots 2/3, 6/7); one fp16
# FMA each makes them q / 256 exactly, and the products run as packed fp16 FMAs (two a lane): per word 1 shift,
# 4 LOP3, 4 bias fixes and 4 HFMA2 (13 instructions for 8 weights, against 19 above). The activations are
# rounded to fp16 (saturating); each 32-column chunk's 16 products a lane add up in fp16, then in float32. With
# q / 256 those sums stay within 16 * 15 / 256 < 1 times the largest activation: they cannot overflow fp16.
HALF2_SLOT_BITS = (0, 16, 4, 20, 8, 24, 12, 28)


@triton.jit
def _half2_pack(lo, hi):
    """Two float32 tensors -> one int32 of two fp16 values (lo in the low half), saturating at fp16's range."""
    return tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half2_word(w, p01, p23, p45, p67, acc):
    """acc (two fp16 sums) + the word's 8 codes times their activations (packed pairs of slots 0/1, 2/3, 4/5,
    6/7), see HALF2."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, a, b, c, d, ka, kb, kc, kd;
        shr.b32 t, $1, 8;
        lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;
        mov.b32 ka, 0x1C001C00;
        mov.b32 kb, 0xC400C400;
        mov.b32 kc, 0x0C000C00;
        mov.b32 kd, 0xB400B400;
        fma.rn.f16x2 a, a, ka, kb;
        fma.rn.f16x2 c, c, ka, kb;
        fma.rn.f16x2 b, b, kc, kd;
        fma.rn.f16x2 d, d, kc, kd;
        fma.rn.f16x2 $0, a, $2, $6;
        fma.rn.f16x2 $0, b, $3, $0;
        fma.rn.f16x2 $0, c, $4, $0;
        fma.rn.f16x2 $0, d, $5, $0;
        }""", "=r,r,r,r,r,r,r", [w, p01, p23, p45, p67, acc], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half2_total(acc):
    """The two fp16 sums of acc added in float32."""
    return tl.inline_asm_elementwise(
        "{ .reg .f16 lo, hi; .reg .f32 a, b; mov.b32 {lo, hi}, $1; cvt.f32.f16 a, lo; cvt.f32.f16 b, hi; "
        "add.f32 $0, a, b; }", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _split4(t):
    """A tensor's last axis of 4 as four tensors (the axis is a thread's own registers: no data moves)."""
    shape: tl.constexpr = t.shape
    even, odd = tl.split(tl.reshape(t, shape[:-1] + [2, 2]))  # j = 2 a + b: b = 0 -> j 0, 2; b = 1 -> 1, 3
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _fp16_product(q, x):
    """q times x rounded to fp16, in float32 (the interpreter's stand-in for the packed products)."""
    return q.to(tl.float32) * x.to(tl.float16).to(tl.float32)


@triton.jit
def _half2_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """sum over the chunk's 32 columns of q x: [C, BM, BN] float32 (words [C, 1, BN, 4] in the HALF2 layout,
    x_s [C, BM, 1, 4] the activations of slot s). Under the interpreter: the same codes and fp16-rounded
    activations in float32."""
    if ASM:
        w0, w1, w2, w3 = _split4(words)
        a0, a1, a2, a3 = _split4(_half2_pack(x0, x1))
        b0, b1, b2, b3 = _split4(_half2_pack(x2, x3))
        c0, c1, c2, c3 = _split4(_half2_pack(x4, x5))
        d0, d1, d2, d3 = _split4(_half2_pack(x6, x7))
        acc = tl.zeros(w0.shape, tl.int32) + tl.zeros(a0.shape, tl.int32)  # [C, BM, BN]
        acc = _half2_word(w0, a0, b0, c0, d0, acc)
        acc = _half2_word(w1, a1, b1, c1, d1, acc)
        acc = _half2_word(w2, a2, b2, c2, d2, acc)
        acc = _half2_word(w3, a3, b3, c3, d3, acc)
        dot = 256.0 * _half2_total(acc)  # the products were of q / 256
    else:
        q0, q1, q2, q3 = words & 15, (words >> 16) & 15, (words >> 4) & 15, (words >> 20) & 15
        q4, q5, q6, q7 = (words >> 8) & 15, (words >> 24) & 15, (words >> 12) & 15, (words >> 28) & 15
        f = (_fp16_product(q0, x0) + _fp16_product(q1, x1) + _fp16_product(q2, x2) + _fp16_product(q3, x3)
             + _fp16_product(q4, x4) + _fp16_product(q5, x5) + _fp16_product(q6, x6) + _fp16_product(q7, x7))
        dot = tl.sum(f, axis=3)
    return dot


@triton.jit
def _x_slot(x_base, cols, mask, K, SILU_MUL: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """The activations at `cols` as float32 (silu(gate) * up with SILU_MUL)."""
    if SILU_MUL:
        x = _activation(x_base, 0, 0, K, cols, mask, True)
    else:
        if MASKED:
            x = tl.load(x_base + cols, mask=mask, other=0.0)
        else:
            x = tl.load(x_base + cols)
        if ASM and x.dtype == tl.bfloat16:
            x = _bf16_pairs_to_float(x)
        else:
            x = x.to(tl.float32)
    return x


@triton.jit
def _sum_squares(x0, x1, x2, x3, x4, x5, x6, x7):
    """Per activation row, the sum of squares of a step's slots: [1, BM, 1, 1]."""
    sq = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7  # [C, BM, 1, 4]
    return tl.sum(tl.sum(sq, axis=3, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _rms_rstd(x_base, x_cols, m_ok, K, eps, STEP: tl.constexpr, ASM: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each activation row, [1, BM, 1, 1], in a pass over the row."""
    total = tl.zeros([1, x_base.shape[1], 1, 1], tl.float32)
    for k0 in range(0, K, STEP):
        mask = (k0 + x_cols < K) & m_ok[None, :, None, None]
        x0, x1, x2, x3, x4, x5, x6, x7 = _slot_activations(x_base, k0 + x_cols, mask, K, False, True, ASM)
        total += _sum_squares(x0, x1, x2, x3, x4, x5, x6, x7)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _norm_weight_slots(nw_ptr, cols, mask):
    """The RMSNorm weight at a step's 8 slots (slot p at cols + 4 p), as stored: constant, so a kernel may
    request them before its PDL wait."""
    return (tl.load(nw_ptr + cols, mask=mask, other=0.0), tl.load(nw_ptr + cols + 4, mask=mask, other=0.0),
            tl.load(nw_ptr + cols + 8, mask=mask, other=0.0), tl.load(nw_ptr + cols + 12, mask=mask, other=0.0),
            tl.load(nw_ptr + cols + 16, mask=mask, other=0.0), tl.load(nw_ptr + cols + 20, mask=mask, other=0.0),
            tl.load(nw_ptr + cols + 24, mask=mask, other=0.0), tl.load(nw_ptr + cols + 28, mask=mask, other=0.0))


@triton.jit
def _slots_normed_by(x0, x1, x2, x3, x4, x5, x6, x7, rstd, w0, w1, w2, w3, w4, w5, w6, w7, DTYPE: tl.constexpr):
    """The 8 slots' activations normed with the weights _norm_weight_slots loaded (gemv_parts._normed)."""
    f32: tl.constexpr = tl.float32
    return (_normed(x0, rstd, w0.to(f32), DTYPE), _normed(x1, rstd, w1.to(f32), DTYPE),
            _normed(x2, rstd, w2.to(f32), DTYPE), _normed(x3, rstd, w3.to(f32), DTYPE),
            _normed(x4, rstd, w4.to(f32), DTYPE), _normed(x5, rstd, w5.to(f32), DTYPE),
            _normed(x6, rstd, w6.to(f32), DTYPE), _normed(x7, rstd, w7.to(f32), DTYPE))


@triton.jit
def _slots_normed(x0, x1, x2, x3, x4, x5, x6, x7, rstd, nw_ptr, cols, mask, DTYPE: tl.constexpr):
    w0, w1, w2, w3, w4, w5, w6, w7 = _norm_weight_slots(nw_ptr, cols, mask)
    return _slots_normed_by(x0, x1, x2, x3, x4, x5, x6, x7, rstd, w0, w1, w2, w3, w4, w5, w6, w7, DTYPE)


@triton.jit
def _slot_activations(x_base, cols, mask, K, SILU_MUL: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr):
    """The activations of a step's 8 slots ([C, BM, 1, 4] each, float32): slot p at cols + 4 p."""
    return (_x_slot(x_base, cols, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 4, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 8, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 12, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 16, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 20, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 24, mask, K, SILU_MUL, MASKED, ASM),
            _x_slot(x_base, cols + 28, mask, K, SILU_MUL, MASKED, ASM))


@triton.jit
def _step_sum(words, sz, x0, x1, x2, x3, x4, x5, x6, x7, HALF2: tl.constexpr, ASM: tl.constexpr):
    """One step's sum (q - z) s x per chunk, [C, BM, BN] float32: words [C, 1, BN, 4] (the HALF2 layout, or the
    float one, see the docstring), sz [C, 1, BN] their scale/zero pairs, x_p the activations of slot p."""
    s = sz.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    z = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if HALF2:
        xs = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=3)  # [C, BM, 1]
        part = s * (_half2_dot(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM) - z * xs)
    else:
        f0, f1, f2, f3, f4, f5, f6, f7 = _slot_floats(words, ASM)
        f = f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3 + f4 * x4 + f5 * x5 + f6 * x6 + f7 * x7  # [C, BM, BN, 4]
        xa = tl.sum(x1 + x3 + x5 + x7, axis=3)  # [C, BM, 1]
        xb = tl.sum(x0 + x2 + x4 + x6, axis=3)
        t = 16.0 * xa + 256.0 * xb
        xs = xa + xb
        part = s * (16.0 * tl.sum(f, axis=3) - t - z * xs)
    return part


@triton.jit
def _step_from_activations(words, sz, x_base, cols, mask, c_ok4, K, rstd, nw_ptr, SILU_MUL: tl.constexpr,
                           MASKED: tl.constexpr, NORM: tl.constexpr, HALF2: tl.constexpr, ASM: tl.constexpr):
    """_step_sum with the step's activations loaded here (at cols: slot 0 of each chunk), and with NORM normed
    (rstd, the weights at nw_ptr)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _slot_activations(x_base, cols, mask, K, SILU_MUL, MASKED, ASM)
    if NORM:
        x0, x1, x2, x3, x4, x5, x6, x7 = _slots_normed(x0, x1, x2, x3, x4, x5, x6, x7, rstd, nw_ptr, cols, c_ok4,
                                                       x_base.dtype.element_ty)
    return _step_sum(words, sz, x0, x1, x2, x3, x4, x5, x6, x7, HALF2, ASM)
