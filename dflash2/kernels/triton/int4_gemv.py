"""Decode GEMV for int4 weights (few activation rows), built to stay memory-bound on Hopper.

At 4 bits a weight the bytes are so few that instructions, not bandwidth, limit a straightforward kernel:
unpacking nibbles, converting them to floats, and reducing partial sums across threads every tile cost ~10
instructions a weight, and the SMs issue about 4 a weight at full bandwidth. This kernel spends ~3:

- Repacked once at prepare() (same bytes as on disk): within each group of GS weights, int32 word j holds
  the codes of columns j, W + j, ..., 7W + j (W = GS / 8 words), nibble p for column p W + j. Nibble p of
  every word then multiplies one contiguous slice of the activation, x[p W : (p + 1) W], so activations are
  plain vector loads and nothing is shuffled between threads.
- A nibble becomes a float with one shift and one bitwise op: its 4 bits go to mantissa bits 19..22 of
  1.0f, giving f = 1 + q / 16 exactly (no int->float conversion, no subtraction).
- Per group g of a row:  sum_k s (q_k - z) x_k = s (16 F_g - (16 + z) X_g), with F_g = sum_k f_k x_k and
  X_g = sum_k x_k. Each thread keeps s * F_g partials in registers across the whole K loop (scales commute
  with the partial sums), and reduces across threads once at the end. F_g and X_g are of the same size, so
  the subtraction loses nothing.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import _activation, _k_range, _store_or_reduce, prepare_io, split_counters

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ONE_BITS = tl.constexpr(0x3F800000)  # 1.0f
NIBBLE_AT_19 = tl.constexpr(0x00780000)  # mantissa bits 19..22


def repack_int4(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """On-disk int4 [N, K/2] u8 (byte j: codes 2j low, 2j + 1 high) -> [N, K/8] int32 in the layout above."""
    n, half = qweight.shape
    k = half * 2
    words = group_size // 8
    codes = torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, k // group_size, 8, words).to(torch.int32)
    # codes[n, g, p, j] = q[g GS + p W + j]: nibble p of word (g, j)
    packed = torch.zeros((n, k // group_size, words), dtype=torch.int32, device=qweight.device)
    for p in range(8):
        packed |= codes[:, :, p, :] << (4 * p)
    return packed.reshape(n, k // 8).contiguous()


@triton.jit
def _nibble_as_float(w, P: tl.constexpr, ASM: tl.constexpr):
    """Nibble P of int32 words as 1 + q / 16 (exact float32). ASM: the mask and the OR as one lop3
    (ptxas keeps them as two instructions otherwise); the interpreter takes the plain ops."""
    if P * 4 <= 19:
        shifted = w << (19 - 4 * P)
    else:
        shifted = w >> (4 * P - 19)  # arithmetic shift: the sign bits fall outside the mask
    if ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780000, 0x3F800000, 0xEA;", "=r,r", [shifted],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (shifted & NIBBLE_AT_19) | ONE_BITS
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, c_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                      stride_sn, stride_om, GS: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_N: tl.constexpr,
                      ASM: tl.constexpr):
    """out[m, n] = sum_g s (16 F_g - c X_g) for every row m < M; s = scale, c = 16 + zero, both float32."""
    W: tl.constexpr = GS // 8
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        n_mask = rows < BLOCK_N * (pid + 1)  # all true; lets the loads drop their masks
    else:
        n_mask = rows < N
    rows = tl.where(n_mask, rows, 0).to(tl.int64)
    t = tl.arange(0, T)
    j = tl.arange(0, W)
    m_idx = tl.arange(0, BLOCK_M)
    m_ok = m_idx < M
    wide = tl.zeros([BLOCK_M, BLOCK_N, T, W], tl.float32)
    corr = tl.zeros([BLOCK_M, BLOCK_N, T], tl.float32)
    w_base = w_ptr + rows[:, None, None] * stride_wn + t[None, :, None] * W + j[None, None, :]
    s_base = rows[:, None] * stride_sn + t[None, :]
    col_base = t[:, None] * GS + j[None, :]  # [T, W]
    x_rows = x_ptr + m_idx[:, None, None] * stride_xm
    for k0 in range(k_start, k_end, T * GS):
        g_ok = (k0 + t * GS) < k_end  # whole groups
        words = tl.load(w_base + k0 // 8, mask=n_mask[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(s_ptr + s_base + k0 // GS, mask=n_mask[:, None] & g_ok[None, :], other=0.0)
        c = tl.load(c_ptr + s_base + k0 // GS, mask=n_mask[:, None] & g_ok[None, :], other=0.0)
        x_mask = m_ok[:, None, None] & g_ok[None, :, None]
        f_sum = tl.zeros([BLOCK_M, BLOCK_N, T, W], tl.float32)
        x_sum = tl.zeros([BLOCK_M, T, W], tl.float32)
        for p in tl.static_range(8):
            x = _activation(x_rows, 0, 0, K, (k0 + col_base + p * W)[None, :, :], x_mask, SILU_MUL)  # [BM, T, W]
            f_sum += _nibble_as_float(words, p, ASM)[None, :, :, :] * x[:, None, :, :]
            x_sum += x
        wide += s[None, :, :, None] * f_sum
        corr += c[None, :, :] * s[None, :, :] * tl.sum(x_sum, axis=2)[:, None, :]
    result = 16.0 * tl.sum(tl.sum(wide, axis=3), axis=2) - tl.sum(corr, axis=2)  # [BM, BN]
    _store_or_reduce(result, out_ptr, ws_ptr, cnt_ptr, m_idx, pid * BLOCK_N + tl.arange(0, BLOCK_N), M, N,
                     stride_om, pid, pid_k, SPLIT_K)


INT4_GEMV_CONFIG = {"BLOCK_N": 64, "T": 1, "num_warps": 4, "num_stages": 3, "SPLIT_K": 0}  # 0: automatic
PROGRAMS_WANTED = 4 * 132  # split K until about this many programs run (a few per SM keep loads in flight)


def prepare_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict:
    """Device tensors for the kernel: repacked words, float32 scale s and c = 16 + zero per (row, group)."""
    if group_size % 8:
        raise ValueError(f"int4 GEMV needs a group size divisible by 8, got {group_size}")
    split_counters(qweight.device, 1 << 16)  # allocated now, not inside a graph capture
    return {"words": repack_int4(qweight, group_size), "s": scales.float().contiguous(),
            "c": (16.0 + zeros.float()).contiguous(), "group_size": group_size,
            "n": qweight.shape[0], "k": qweight.shape[1] * 2}


def int4_gemv(x: torch.Tensor, weight: dict, out: torch.Tensor | None = None, silu_mul: bool = False,
              config: dict | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul; M small) @ W^T for a weight from prepare_int4."""
    x, out = prepare_io(x, weight, out, silu_mul)
    (m, n), k = out.shape, weight["k"]
    if m == 0:
        return out
    config = config or INT4_GEMV_CONFIG
    block_n = config["BLOCK_N"]
    gs = weight["group_size"]
    t = max(1, min(config["T"], k // gs))
    while (k // gs) % t:
        t //= 2
    tiles = triton.cdiv(n, block_n)
    split_k = config.get("SPLIT_K") or max(1, min(16, triton.cdiv(PROGRAMS_WANTED, tiles), k // (gs * t)))
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, tiles) if split_k > 1 else out
    _int4_gemv_kernel[(tiles, split_k)](
        x, weight["words"], weight["s"], weight["c"], out, ws, counters, m, n, k, x.stride(0),
        weight["words"].stride(0), weight["s"].stride(0), out.stride(0), GS=gs, T=t,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, SPLIT_K=split_k, SILU_MUL=silu_mul,
        EVEN_N=n % block_n == 0, ASM=not _INTERPRETED, num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    return out
