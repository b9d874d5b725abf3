"""The MoE router in one launch (CUDA): logits, softmax, top-k, renormalization and the cast, as SparseMoeBlock.route
computes them with torch in six launches (linear, softmax, topk, sum, div, to), each a gap in a decode step:

    logits  = x W^T, rounded to x's dtype (F.linear's output)
    probs   = softmax(logits) in float32
    weights, ids = the top_k probs, largest first (the first expert among equal probs)
    weights /= weights.sum()                     (norm_topk_prob)
    weights -> x's dtype                         (unless the model keeps them in float32: Mixtral)

route_small (up to FUSED_MAX_TOKENS tokens, decode): the grid is tokens x blocks of BLOCK_E experts; each program
reads its experts' gate rows in one pass (loads in flight together; requested before the programmatic-dependent-
launch wait, as the GEMVs request their first weights) and parks their logits in a float32
workspace, then takes a ticket from its token's counter; the token's last program (the ticket is acq_rel, so it
sees every other program's logits) picks the top-k and resets the counter. route_logits (more tokens, prefill):
the logits come from cuBLAS (F.linear: one weight read for all tokens), a program a token does the rest.
moe_route_normed (route_small with the row in one pass): the layer's RMSNorm folded in; the router reads the
residual stream, norms it as rms_norm does and hands the normed rows to the experts (models/llama.py fuses_norms).

The logits' sum runs in another order than cuBLAS's, so a logit may round to the next 16-bit value; the dense
GEMV kernels of the decode path differ from cuBLAS the same way. Ties among the top-k probs go to the lower
expert id (torch's CUDA topk does not promise an order there). CUDA graphs: launch shapes depend on T and E only;
no host syncs; counters are zero between calls.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.gemv_parts import _normed, _reset_ticket, split_counters
from dflash2.kernels.triton.pdl import pdl_args, pdl_start

FUSED_MAX_TOKENS = 16  # above: F.linear's one weight read for all tokens beats a read per token
TILE = 4096  # gate elements a program reads at once (32 a thread of 4 warps): hidden 2048, two experts a program


@triton.jit
def _select(logits, e_ok, weights_ptr, ids_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
            E_PAD: tl.constexpr):
    """Softmax over the float32 logits [E_PAD] (e_ok: the real experts), the TOP_K largest probs and their ids
    (largest first), renormalized if NORM; stored as weights_ptr's dtype and ids_ptr's."""
    logits = tl.where(e_ok, logits, float("-inf"))
    p = tl.where(e_ok, tl.exp(logits - tl.max(logits, 0)), 0.0)
    probs = tl.where(e_ok, p / tl.sum(p, 0), -1.0)  # -1: never picked
    # NaN (a padding row's garbage) as 0: the argmax then still picks real experts, never a padded id >= E
    probs = tl.where(probs == probs, probs, 0.0)
    experts = tl.arange(0, E_PAD)
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # one reduction a pick (the value and its first index)
        value, best = tl.max(probs, 0, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where(slots == j, value, top_w)
        top_i = tl.where(slots == j, best, top_i)
        probs = tl.where(experts == best, -1.0, probs)
    if NORM:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + slots, top_w.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + slots, top_i.to(ids_ptr.dtype.element_ty), mask=slots < TOP_K)


@triton.jit
def _route_small_kernel(x_ptr, w_ptr, ws_ptr, cnt_ptr, weights_ptr, ids_ptr, E, H, stride_xm, stride_we,
                        nw_ptr, eps, h_ptr, stride_hm,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PASS: tl.constexpr,
                        USE_PDL: tl.constexpr, RMS_NORM: tl.constexpr = False):
    """RMS_NORM (ONE_PASS): x is the residual stream; the router reads its RMSNorm with weight nw (rms_norm's
    arithmetic), and the first program of each token stores that row in h for the experts."""
    t, b = tl.program_id(0), tl.program_id(1)
    experts = b * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < E
    rows = tl.where(e_ok, experts, 0).to(tl.int64) * stride_we
    x_row = x_ptr + t.to(tl.int64) * stride_xm
    if ONE_PASS:  # BLOCK_H covers H: the gate rows requested before the wait (no kernel writes them), while the
        hs = tl.arange(0, BLOCK_H)  # kernel before (the norm that makes x) finishes; every load in flight at once
        w = tl.load(w_ptr + rows[:, None] + hs[None, :], mask=e_ok[:, None] & (hs < H)[None, :], other=0.0)
        if RMS_NORM:  # constants too
            nw = tl.load(nw_ptr + hs, mask=hs < H, other=0.0).to(tl.float32)
        pdl_start(USE_PDL)
        a = tl.load(x_row + hs, mask=hs < H, other=0.0).to(tl.float32)
        if RMS_NORM:
            dtype = x_ptr.dtype.element_ty
            a = _normed(a, tl.rsqrt(tl.sum(a * a, axis=0) / H + eps), nw, dtype)
            if b == 0:
                tl.store(h_ptr + t.to(tl.int64) * stride_hm + hs, a.to(dtype), mask=hs < H)
        acc = w.to(tl.float32) * a[None, :]
    else:
        pdl_start(USE_PDL)
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            a = tl.load(x_row + hs, mask=hs < H, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] + hs[None, :], mask=e_ok[:, None] & (hs < H)[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
    logits = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as F.linear's output
    if E_PAD == BLOCK_E:  # one program a token
        _select(logits, e_ok, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, K_PAD, NORM, E_PAD)
    else:
        ws_row = ws_ptr + t * E_PAD
        tl.store(ws_row + experts, logits)
        tl.debug_barrier()  # every thread's logits are written before the ticket (release) is taken
        if tl.atomic_add(cnt_ptr + t, 1) == tl.num_programs(1) - 1:
            all_experts = tl.arange(0, E_PAD)
            row = tl.load(ws_row + all_experts, cache_modifier=".cg")
            _select(row, all_experts < E, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, K_PAD, NORM,
                    E_PAD)
            _reset_ticket(cnt_ptr + t)


@triton.jit
def _route_logits_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_lm, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         NORM: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    e_ok = experts < E
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lm + experts, mask=e_ok, other=0.0).to(tl.float32)
    _select(logits, e_ok, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, K_PAD, NORM, E_PAD)


def fuses_norm(num_tokens: int, hidden: int) -> bool:
    """Whether moe_route_normed takes these tokens: route_small with the whole row in one pass."""
    return num_tokens <= FUSED_MAX_TOKENS and triton.next_power_of_2(hidden) <= TILE


def moe_route_normed(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool,
                     weights_dtype: torch.dtype, norm: tuple[torch.Tensor, float]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_route of RMSNorm(x) with norm = (weight [H], eps), in the same launch: (weights, ids, the normed rows
    [T, H]) for x the residual stream (not changed); only where fuses_norm."""
    if not fuses_norm(x.shape[0], x.shape[1]):
        raise ValueError(f"moe_route_normed: {x.shape[0]} tokens of {x.shape[1]} take the separate norm")
    if norm[0].shape != (x.shape[1],) or norm[0].dtype != x.dtype:
        raise ValueError(f"moe_route_normed: norm weight [{x.shape[1]}] {x.dtype} expected, got "
                         f"{tuple(norm[0].shape)} {norm[0].dtype}")
    normed = torch.empty_like(x)
    weights, ids = moe_route(x, gate, top_k, norm_topk_prob, weights_dtype, norm=norm, normed=normed)
    return weights, ids, normed


def moe_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool,
              weights_dtype: torch.dtype, norm: tuple[torch.Tensor, float] | None = None,
              normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in weights_dtype, ids [T, top_k] int64) for x [T, H] and the router's gate [E, H] of
    x's dtype: SparseMoeBlock.route's result (the module docstring says where it may differ). norm, normed:
    moe_route_normed's."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    if gate.shape[1] != hidden or gate.dtype != x.dtype or not 0 < top_k <= num_experts:
        raise ValueError(f"moe_route: gate {tuple(gate.shape)} {gate.dtype} for x {tuple(x.shape)} {x.dtype}, "
                         f"top_k {top_k}")
    if x.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError("moe_route: x's and the gate's rows must be contiguous")
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    e_pad, k_pad = triton.next_power_of_2(num_experts), max(2, triton.next_power_of_2(top_k))
    select = {"TOP_K": top_k, "K_PAD": k_pad, "NORM": norm_topk_prob, "E_PAD": e_pad, **pdl_args()}
    if num_tokens <= FUSED_MAX_TOKENS:
        # the whole row at once up to TILE (a loop of dependent loads took 11.5 us a layer of qwen3-30b-a3b
        # on an H100, BLOCK_H 256 x 8 experts); E = 128, H = 2048: 64 programs a token, two gate rows each
        block_h = min(triton.next_power_of_2(hidden), TILE)
        block_e = min(e_pad, max(1, TILE // block_h))
        blocks = triton.cdiv(num_experts, block_e)
        ws = torch.empty((num_tokens, e_pad), dtype=torch.float32, device=x.device) if blocks > 1 else weights
        counters = split_counters(x.device, num_tokens) if blocks > 1 else weights
        norm_weight, eps = norm if norm is not None else (x, 0.0)  # x: any pointer, never read without a norm
        h = normed if normed is not None else x
        _route_small_kernel[(num_tokens, blocks)](
            x, gate, ws, counters, weights, ids, num_experts, hidden, x.stride(0), gate.stride(0), norm_weight, eps,
            h, h.stride(0), BLOCK_E=block_e, BLOCK_H=block_h, ONE_PASS=block_h >= hidden, num_warps=4,
            RMS_NORM=norm is not None, **select)
    else:
        logits = torch.nn.functional.linear(x, gate)
        _route_logits_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), num_warps=4,
                                            **select)
    return weights, ids
