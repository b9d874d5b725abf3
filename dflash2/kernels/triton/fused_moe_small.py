"""The fused MoE for a few (token, slot) pairs (decode): GEMVs straight from topk_ids, in two launches.

fused_moe.py's path sorts the pairs into blocks of BLOCK_M rows for tl.dot; at T k = 8 pairs (one token, top-8)
that is one real row in sixteen, a few hundred programs in all, and one or two alignment launches before them.
Here every program takes one pair and one tile of BLOCK_N output columns (optionally a 1/SPLIT_K share of K):

    _small_gate_up_kernel  grid (T k * cdiv(I, BLOCK_N), SPLIT_K): the pair's expert from topk_ids, its token's
                           row of x times the expert's gate and up rows as [BLOCK_N, BLOCK_K] tiles (float32
                           products summed along K at the end), SiLU(gate) * up in the epilogue
                           -> hidden [T k, I] in x's dtype, row p for pair p
    _small_down_kernel     grid (T k * cdiv(H, BLOCK_N), SPLIT_K): hidden[p] times the down rows; the k slots
                           of a token (and the K shares) meet in the last program to finish their tile
                           -> out [T, H]

Programs run pair-fastest (pid % T k is the pair), so the pairs that share an expert read its tile at about the
same time (from L2 after the first). Weights as fused_moe.py reads them (its _weight_tile: 16, 8, 6 and 4 bits).

Rounding is the module docstring's of fused_moe.py: gate and up rounded to x's dtype before silu_mul; the down
product rounded, times the router weight in float32, rounded; the k slots summed in float32 in slot order and
rounded once (torch's sum of the per-slot rows); dequantized 4/6-bit weights rounded to x's dtype first.

Split sums without atomics on the values: a program parks its float32 partial in a workspace and takes a ticket
from its tile's counter (gemv_parts.split_counters); the last one sums the partials in a fixed order, so the
result does not depend on the order the programs ran in, and resets the counter. CUDA graphs: the launch shapes
depend only on T, k, E and the config; no host syncs; the counters stay zero between calls.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.elementwise import _silu_mul
from dflash2.kernels.triton.fused_moe import _weight_tile, pieces
from dflash2.kernels.triton.gemv_parts import _block_indices, _k_range, _reset_ticket, _store_out, split_counters
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # fused_moe._checked_weight's (w, scales, zeros, group)


# -- device helpers --------------------------------------------------------------------------------------
@triton.jit
def _weights(w_ptr, s_ptr, z_ptr, rows64, ks, k0, K, stride_wn, stride_sn, BITS: tl.constexpr, GROUP: tl.constexpr,
             GS: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """w[row, k] as float32 [BLOCK_N, T GS] for the expert's rows `rows64` at the step's columns ks = k0 + ...
    [1, T GS] below K: 8 bits the codes (the row scale comes later), 4/6 bits the weights rounded to DTYPE (the
    activations' dtype)."""
    if BITS == 16 or BITS == 8:  # a plain 2-D tile (_weight_tile's [BLOCK_N, T, GS] form is for groups)
        return tl.load(w_ptr + rows64[:, None] * stride_wn + ks, mask=ks < K, other=0).to(tl.float32)
    w = _weight_tile(w_ptr, s_ptr, z_ptr, rows64, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T, BLOCK_N)
    return w.to(DTYPE).to(tl.float32)


@triton.jit
def _products(w_ptr, s_ptr, z_ptr, rows64, a, ks, k0, K, stride_wn, stride_sn, BITS: tl.constexpr,
              GROUP: tl.constexpr, GS: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr):
    """w[row, k] * a[k] as float32 [BLOCK_N, T GS] (_weights' tile; a: the activations there, [1, T GS] in x's
    dtype)."""
    w = _weights(w_ptr, s_ptr, z_ptr, rows64, ks, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T, BLOCK_N, a.dtype)
    return w * a.to(tl.float32)


@triton.jit
def _ticket(partial, ws_ptrs, mask, counter):
    """Park this program's partial, then its ticket from the tile's counter (acq_rel: the partial is visible to
    whoever takes the last one, which sees every other partial)."""
    tl.store(ws_ptrs, partial, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(counter, 1)


@triton.jit
def _split_total(ws_ptrs, split_size, mask, SPLIT_K: tl.constexpr):
    """The SPLIT_K partials parked split_size apart, summed in split order."""
    total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLIT_K):
        total += tl.load(ws_ptrs + split * split_size, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_hidden(gate, up, hidden_ptrs, mask, s_ptr, cols64, I, stride_sn, BITS: tl.constexpr):
    """SiLU(gate) * up of the finished sums (times the row scales at 8 bits), rounded to the hidden's dtype."""
    if BITS == 8:
        gate *= tl.load(s_ptr + cols64 * stride_sn).to(tl.float32)
        up *= tl.load(s_ptr + (cols64 + I) * stride_sn).to(tl.float32)
    dtype = hidden_ptrs.dtype.element_ty
    tl.store(hidden_ptrs, _silu_mul(gate.to(dtype), up.to(dtype)), mask=mask)


@triton.jit
def _slot_value(acc, pair, ids_ptr, router_ptr, s_ptr, cols64, stride_se, stride_sn, BITS: tl.constexpr,
                DTYPE: tl.constexpr):
    """One slot's row as fused_moe's per-slot row holds it (float32 of the rounded value): the down product
    (times the row scales at 8 bits) rounded, times the router weight, rounded."""
    if BITS == 8:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        acc *= tl.load(s_ptr + expert * stride_se + cols64 * stride_sn).to(tl.float32)
    router = tl.load(router_ptr + pair).to(tl.float32)
    return (acc.to(DTYPE).to(tl.float32) * router).to(DTYPE).to(tl.float32)


# -- kernels ---------------------------------------------------------------------------------------------
@triton.jit
def _small_gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, hidden_ptr, ws_ptr, cnt_ptr, ids_ptr, num_pairs, I, K,
                          stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                          TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr,
                          T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
    """hidden[p, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for the pair p = t k + j, e = topk_ids[t, j], n in
    one tile of BLOCK_N of the I columns; split along K: ws [SPLIT_K, T k, 2 I] float32 (gate, then up)."""
    pdl_start(USE_PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pair = pid % num_pairs
    cols, col_ok, cols64 = _block_indices((pid // num_pairs) * BLOCK_N, I, BLOCK_N)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    z_ptr += expert * stride_se
    a_ptr = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    gate = tl.zeros([BLOCK_N, T * GS], tl.float32)  # summed along K once, after the loop
    up = tl.zeros([BLOCK_N, T * GS], tl.float32)
    for k0 in range(k_start, k_end, T * GS):  # the gate and up tiles' loads in flight together
        ks = k0 + tl.arange(0, T * GS)[None, :]
        a = tl.load(a_ptr + ks, mask=ks < K, other=0.0)
        gate += _products(w_ptr, s_ptr, z_ptr, cols64, a, ks, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T,
                          BLOCK_N)
        up += _products(w_ptr, s_ptr, z_ptr, cols64 + I, a, ks, k0, K, stride_wn, stride_sn, BITS, GROUP, GS, T,
                        BLOCK_N)
    gate = tl.sum(gate, axis=1)
    up = tl.sum(up, axis=1)
    hidden_ptrs = hidden_ptr + pair.to(tl.int64) * stride_hm + cols
    if SPLIT_K == 1:
        _store_hidden(gate, up, hidden_ptrs, col_ok, s_ptr, cols64, I, stride_sn, BITS)
    else:
        split_size = num_pairs * 2 * I
        ws_ptrs = ws_ptr + pair.to(tl.int64) * 2 * I + cols
        tl.store(ws_ptrs + pid_k * split_size + I, up, mask=col_ok)
        ticket = _ticket(gate, ws_ptrs + pid_k * split_size, col_ok, cnt_ptr + pid)
        if ticket == SPLIT_K - 1:
            gate = _split_total(ws_ptrs, split_size, col_ok, SPLIT_K)
            up = _split_total(ws_ptrs + I, split_size, col_ok, SPLIT_K)
            _store_hidden(gate, up, hidden_ptrs, col_ok, s_ptr, cols64, I, stride_sn, BITS)
            _reset_ticket(cnt_ptr + pid)


@triton.jit
def _small_down_kernel(hidden_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, ids_ptr, router_ptr, num_pairs,
                       N, K, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                       TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GS: tl.constexpr,
                       T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
                       ADD_OUT: tl.constexpr = False):
    """out[t, n] = sum_j router[p] * (hidden[p] . down_e[n]), p = t k + j, e = topk_ids[t, j], n in one tile of
    BLOCK_N of the N = H columns; the pair's partial in ws [SPLIT_K, T k, N] float32 and the token's tile counter
    (T cdiv(N, BLOCK_N) of them) taking k SPLIT_K tickets, unless k = SPLIT_K = 1. ADD_OUT: out += that (the
    residual add, rounded as gemv_parts._added; out is read after the PDL wait).
    The pair's expert id and its first K step of weights are read before the PDL wait: the ids' writer (the
    router) is the kernel before the gate_up kernel, which has completed once this one starts (pdl.py's rule), and
    no kernel writes weights; so the step's weights stream in while gate_up finishes."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pair = pid % num_pairs
    tile = pid // num_pairs
    cols, col_ok, cols64 = _block_indices(tile * BLOCK_N, N, BLOCK_N)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptr += expert * stride_we
    a_ptr = hidden_ptr + pair.to(tl.int64) * stride_hm
    k_start, k_end = _k_range(K, pid_k, T * GS, SPLIT_K)
    dtype = out_ptr.dtype.element_ty
    ks = k_start + tl.arange(0, T * GS)[None, :]
    w = _weights(w_ptr, s_ptr + expert * stride_se, z_ptr + expert * stride_se, cols64, ks, k_start, k_end,
                 stride_wn, stride_sn, BITS, GROUP, GS, T, BLOCK_N, dtype)
    pdl_start(USE_PDL)
    wide = w * tl.load(a_ptr + ks, mask=ks < k_end, other=0.0).to(tl.float32)
    for k0 in range(k_start + T * GS, k_end, T * GS):
        ks = k0 + tl.arange(0, T * GS)[None, :]
        a = tl.load(a_ptr + ks, mask=ks < K, other=0.0)
        wide += _products(w_ptr, s_ptr + expert * stride_se, z_ptr + expert * stride_se, cols64, a, ks, k0, K,
                          stride_wn, stride_sn, BITS, GROUP, GS, T, BLOCK_N)
    acc = tl.sum(wide, axis=1)
    if TOP_K * SPLIT_K == 1:
        y = _slot_value(acc, pair, ids_ptr, router_ptr, s_ptr, cols64, stride_se, stride_sn, BITS, dtype)
        _store_out(y, out_ptr + pair.to(tl.int64) * stride_om + cols, col_ok, ADD_OUT)
    else:
        token = pair // TOP_K
        split_size = num_pairs * N
        ws_ptrs = ws_ptr + cols  # + the pair's row
        counter = cnt_ptr + token * tl.cdiv(N, BLOCK_N) + tile
        ticket = _ticket(acc, ws_ptrs + pid_k * split_size + pair.to(tl.int64) * N, col_ok, counter)
        if ticket == TOP_K * SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], tl.float32)
            for slot in tl.static_range(TOP_K):
                slot_pair = token * TOP_K + slot
                slot_acc = _split_total(ws_ptrs + slot_pair.to(tl.int64) * N, split_size, col_ok, SPLIT_K)
                total += _slot_value(slot_acc, slot_pair, ids_ptr, router_ptr, s_ptr, cols64, stride_se, stride_sn,
                                     BITS, dtype)
            _store_out(total, out_ptr + token.to(tl.int64) * stride_om + cols, col_ok, ADD_OUT)
            _reset_ticket(counter)


# -- launcher --------------------------------------------------------------------------------------------
def fused_moe_small(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, bits: int, gate_up_config: dict, down_config: dict,
                    add_to: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe's result for x [T, H] on its checked weights (fused_moe._checked_weight's tuples) and configs with
    SMALL set (fused_moe_configs.py: BLOCK_N, BLOCK_K, SPLIT_K, num_warps a GEMM); add_to: added into that [T, H]
    tensor in the down kernel's store, and it returned."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    inter = gate_up[0].shape[1] // 2
    hidden_rows = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x) if add_to is None else add_to
    w, scales, zeros, group = gate_up
    tile_args, split_k = _tile_args(bits, group, hidden, gate_up_config)
    grid = num_pairs * triton.cdiv(inter, gate_up_config["BLOCK_N"])
    ws = torch.empty((split_k, num_pairs, 2 * inter), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = split_counters(x.device, grid) if split_k > 1 else out
    _small_gate_up_kernel[(grid, split_k)](
        x, w, scales, zeros, hidden_rows, ws, counters, topk_ids, num_pairs, inter, hidden, x.stride(0), w.stride(0),
        w.stride(1), scales.stride(0), scales.stride(1), hidden_rows.stride(0), TOP_K=top_k, **tile_args,
        **_launch_args(gate_up_config))
    w, scales, zeros, group = down
    tile_args, split_k = _tile_args(bits, group, inter, down_config)
    num_tiles = triton.cdiv(hidden, down_config["BLOCK_N"])
    tickets = top_k * split_k > 1
    ws = torch.empty((split_k, num_pairs, hidden), dtype=torch.float32, device=x.device) if tickets else out
    counters = split_counters(x.device, num_tokens * num_tiles) if tickets else out
    _small_down_kernel[(num_pairs * num_tiles, split_k)](
        hidden_rows, w, scales, zeros, out, ws, counters, topk_ids, topk_weights, num_pairs, hidden, inter,
        hidden_rows.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
        TOP_K=top_k, **tile_args, ADD_OUT=add_to is not None, **_launch_args(down_config))
    return out


def _tile_args(bits: int, group: int, k: int, config: dict) -> tuple[dict, int]:
    """The kernel's tile constants, and SPLIT_K cut to the K steps there are (a split of no steps is a wasted
    program)."""
    gs, t = pieces(bits, group, config["BLOCK_K"])
    split_k = max(1, min(config["SPLIT_K"], triton.cdiv(k, gs * t)))
    return {"BITS": bits, "GROUP": group, "GS": gs, "T": t, "BLOCK_N": config["BLOCK_N"], "SPLIT_K": split_k}, split_k


def _launch_args(config: dict) -> dict:
    return {"num_warps": config["num_warps"], **pdl_args()}
