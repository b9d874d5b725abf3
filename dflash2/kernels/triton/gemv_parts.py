"""Pieces the GEMV kernels share (quant_matmul.py, int4_gemv.py).

    _activation     one activation row at some columns as float32, optionally silu(gate) * up of a fused
                    [gate | up] row, rounded as the unfused silu_and_mul would
    _normed         an RMSNorm folded into the kernel that reads its output, rounded as rms_norm rounds
    _block_indices  a program's block of row indices, their mask, and the clamped int64 indices it loads with
    prepare_io      the launchers' input check ([M, K], or [M, 2K] with SiLU-mul) and output allocation
    shape_configs   kernel configs per weight shape from a tune's JSON file (DFLASH2_INT4_CONFIGS, ..._GEMM_...)
    multiprocessors a CUDA device's SM count (grid sizes)
    _l2_prefetch    ask L2 for a range a program reads later, in one bulk prefetch (no register holds it)
    split-K         several programs share one output tile along K, in one launch:

Each program parks its fp32 partial in a workspace and takes a ticket from the tile's counter; the last one
sums the partials, stores the tile and resets the counter (_reset_ticket, without a fence), so the counters stay
zero between calls and the whole thing is safe inside CUDA graphs. The split decode attention (attention.py) and
the greedy argmax (step_edges.py) take their tickets from the same `split_counters` (kernels on one stream never
hold tickets at the same time).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import triton
import triton.language as tl

from dflash2.kernels.triton.elementwise import _silu_mul

# inline PTX on the GPU (the ASM constexpr of the kernels that take it); plain ops, or nothing for a hint such as
# _l2_prefetch, under the interpreter
INLINE_ASM = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _activation(x_ptr, m, stride_xm, K, cols, mask, SILU_MUL: tl.constexpr):
    """Activation row m at `cols` as float32; with SILU_MUL the row is [gate | up] and this is silu(gate) * up."""
    ptrs = x_ptr + m * stride_xm + cols
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        value = _silu_mul(gate, up).to(tl.float32)
    else:
        value = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def _normed(x, rstd, nw, DTYPE: tl.constexpr):
    """rms_norm's output as float32 (the GEMV's and the router's folded norm): (x rstd) rounded to DTYPE, times
    the weight nw (float32 of a DTYPE value), rounded; the product of two 16-bit values is exact in float32, so
    this is their 16-bit product."""
    return (nw * (x * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, m_idx, rows, M, N, stride_om, tile_id, pid_k,
                     SPLIT_K: tl.constexpr, ADD_OUT: tl.constexpr = False):
    """Store [BLOCK_M, BLOCK_N] fp32; split along K, park it in the workspace and let the last program of
    this tile (a ticket from the tile's counter) sum all SPLIT_K partials, store, and reset the counter.
    ADD_OUT: out += the result (rounded to out's dtype first, as a separate residual add would see it)."""
    mask = (m_idx < M)[:, None] & (rows < N)[None, :]
    out_offs = m_idx[:, None] * stride_om + rows[None, :]
    if SPLIT_K == 1:
        _store_out(acc, out_ptr + out_offs, mask, ADD_OUT)
    else:
        ws_offs = m_idx[:, None] * N + rows[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(cnt_ptr + tile_id, 1)
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in range(SPLIT_K):
                total += tl.load(ws_ptr + split * M * N + ws_offs, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, out_ptr + out_offs, mask, ADD_OUT)
            _reset_ticket(cnt_ptr + tile_id)


@triton.jit
def _reset_ticket(counter):
    """The last ticket's program sets its counter back to zero for the next launch (split-K here, decode attention's
    merge, the greedy argmax). Relaxed: an acq_rel atomic puts a MEMBAR.ALL.GPU before it, which holds the program
    until its output stores are acknowledged. Nothing in this launch reads the counter after the last ticket, and the
    next launch that uses it takes its tickets only after its PDL wait (or in stream order), once this grid has
    completed. The ticket itself stays acq_rel (its release orders the partials before it). W2 int4 on the H200
    (twenty-sixth session, call 1; decode attention's reset): 600.8 / 600.7 tok/s relaxed, against 597.5 / 597.0 /
    597.6 with the fence."""
    tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _store_out(value, ptrs, mask, ADD_OUT: tl.constexpr):
    if ADD_OUT:
        value = _added(value, tl.load(ptrs, mask=mask, other=0.0), ptrs.dtype.element_ty)
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _added(value, prior, DTYPE: tl.constexpr):
    """The residual add as torch adds two tensors of out's dtype: value rounded to it, then in float32, rounded
    once (as float32: the caller stores it)."""
    return value.to(DTYPE).to(tl.float32) + prior.to(tl.float32)


@triton.jit
def _l2_prefetch(ptr, count, ASM: tl.constexpr):
    """Ask L2 for the `count` elements from ptr on, which this program reads later: thread 0 issues one
    cp.async.bulk.prefetch.L2 and the copy engine streams the range in while the program computes; its own
    loads then find the lines in L2. The bulk prefetch takes 16-byte units, so the range is cut to the whole
    units inside [ptr rounded down to 16, the end) (inside the tensor, whose start is aligned). A hint: nothing
    waits for it, and a line evicted before it is read is read again. Nothing under the interpreter, or for
    count <= 0."""
    if ASM:
        start = ptr.to(tl.int64)
        aligned = start & ~15
        # count <= 0 leaves size <= 0 (the start is less than 16 bytes past `aligned`), which the asm skips
        size = ((start + count * (ptr.dtype.element_ty.primitive_bitwidth // 8) - aligned) & ~15).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.gt.s32 q, $2, 0; "
            "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [aligned, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _block_indices(first, count, BLOCK: tl.constexpr):
    """A program's BLOCK indices from `first` (rows of a weight, or of the activations), which of them are < count,
    and the same indices as int64 with the ones past count clamped to 0 (safe to load from under a mask)."""
    idx = first + tl.arange(0, BLOCK)
    ok = idx < count
    return idx, ok, tl.where(ok, idx, 0).to(tl.int64)


@triton.jit
def _k_range(K, pid_k, TILE_K: tl.constexpr, SPLIT_K: tl.constexpr):
    tiles_per_split = tl.cdiv(tl.cdiv(K, TILE_K), SPLIT_K)
    k_start = pid_k * tiles_per_split * TILE_K
    return k_start, tl.minimum(K, k_start + tiles_per_split * TILE_K)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 tickets for split-K (each tile's last program resets its own). Allocated outside any graph
    capture: the first call with a new size should run eagerly (warm-up) before capturing."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < size:
        counters = torch.zeros(max(size, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def prepare_io(x: torch.Tensor, weight: dict[str, Any], out: torch.Tensor | None,
               silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation checked ([M, K], or [M, 2K] with silu_mul) with unit column stride, and the output."""
    k = weight["k"]
    if x.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"expected x [M, {2 * k if silu_mul else k}], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    return x, torch.empty((x.shape[0], weight["n"]), dtype=x.dtype, device=x.device) if out is None else out


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (the persistent int4 GEMV's grid unit, the decode attention's split count); 2
    elsewhere (the interpreter), so that tests see programs taking several tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


@functools.cache
def shape_configs(variable: str) -> dict[tuple[int, ...], dict]:
    """The JSON file the environment variable names, {"NxK": config} or {"bits:NxK": config} as the tunes'
    --configs-out write it, keyed by (N, K) or (bits, N, K); empty without the variable."""
    path = os.environ.get(variable)
    if not path:
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        return {tuple(int(v) for v in key.replace(":", "x").split("x")): _checked(config)
                for key, config in table.items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{variable}={path}: not a table of kernel configs ({{\"NxK\": {{\"BLOCK_N\": ...}}}}): "
                         f"{e}") from e


def _checked(config: Any) -> dict:
    if not isinstance(config, dict) or not {"BLOCK_N", "num_warps", "num_stages"} <= config.keys():
        raise ValueError(f"a config needs BLOCK_N, num_warps and num_stages, got {config!r}")
    return config
