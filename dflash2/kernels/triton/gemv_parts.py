"""Pieces the GEMV kernels share (quant_matmul.py, int4_gemv.py).

    _activation     one activation row at some columns as float32, optionally silu(gate) * up of a fused
                    [gate | up] row, rounded as the unfused silu_and_mul would
    prepare_io      the launchers' input check ([M, K], or [M, 2K] with SiLU-mul) and output allocation
    early weights   what a program asks for of its weight before gdc_wait (below)
    split-K         several programs share one output tile along K, in one launch:

Each program parks its fp32 partial in a workspace and takes a ticket from the tile's counter; the last one
sums the partials, stores the tile and resets the counter, so the counters stay zero between calls and the
whole thing is safe inside CUDA graphs. The split decode attention (attention.py) takes its tickets from the
same `split_counters` (kernels on one stream never hold tickets at the same time).

Early weights (issue 6). No kernel writes a weight, so a GEMV program may request its slice before it waits
for the previous kernel (pdl.py): it calls gdc_launch_dependents, asks for the weight, then gdc_waits and
reads the activation. Under PDL its weight stream then overlaps the predecessor's tail (norm, rotary,
attention: DRAM idle), and without PDL it is still a deeper prefetch. Two ways, per launch:

    EARLY_L2_MB   L2 budget in MiB (0: off): each program asks L2 (cp.async.bulk.prefetch.L2, one request
                  a row, the TMA unit splits it) for the start of each of its rows' K range: all of it
                  when the programs resident at once fit the budget together, an equal share otherwise
                  (an H200 has 50 MB of L2; more than fits would be fetched twice)
    EARLY_REGS    int4_gemv.py only: the first K step's words and scales are loaded into registers before
                  the wait (configs with PREFETCH, and kernels of one K step, where that is all of it)

Config keys over EARLY_DEFAULTS, which are off: on the H200 both were slower in a real W2 step
(benchmarks/decode_chain_bench.py, int4 chain 2.00 ms off, 2.00 regs, 2.17 L2 16 MiB, 2.10 both; latency.py W2
bf16 230.9 off vs 226.4 on, int4 453.5 vs 423.2; RESULTS.md). DFLASH2_GEMV_EARLY=0 turns both off whatever
the configs say, =l2 (budget EARLY_ON_MB unless set) or =regs turns one on for every launch;
DFLASH2_GEMV_EARLY_MB=<MiB> sets the budget. Never under the interpreter (no PTX there): EARLY_REGS still runs
there, EARLY_L2 does not.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _activation(x_ptr, m, stride_xm, K, cols, mask, SILU_MUL: tl.constexpr):
    """Activation row m at `cols` as float32; with SILU_MUL the row is [gate | up] and this is silu(gate) * up."""
    ptrs = x_ptr + m * stride_xm + cols
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
        value = (silu * up.to(tl.float32)).to(up.dtype).to(tl.float32)  # = the product in up's dtype
    else:
        value = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def _store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, m_idx, rows, M, N, stride_om, tile_id, pid_k,
                     SPLIT_K: tl.constexpr):
    """Store [BLOCK_M, BLOCK_N] fp32; split along K, park it in the workspace and let the last program of
    this tile (a ticket from the tile's counter) sum all SPLIT_K partials, store, and reset the counter."""
    mask = (m_idx < M)[:, None] & (rows < N)[None, :]
    out_offs = m_idx[:, None] * stride_om + rows[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_offs = m_idx[:, None] * N + rows[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(cnt_ptr + tile_id, 1)
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in range(SPLIT_K):
                total += tl.load(ws_ptr + split * M * N + ws_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0)


@triton.jit
def _k_range(K, pid_k, TILE_K: tl.constexpr, SPLIT_K: tl.constexpr):
    tiles_per_split = tl.cdiv(tl.cdiv(K, TILE_K), SPLIT_K)
    k_start = pid_k * tiles_per_split * TILE_K
    return k_start, tl.minimum(K, k_start + tiles_per_split * TILE_K)


# PTX: thread t < num_rows asks L2 for `num_bytes` from `first + t * stride` (widened to whole 16-byte blocks,
# never past the block holding the last byte: no other page is touched)
_PREFETCH_ROWS_PTX = tl.constexpr("""{
    .reg .pred p;
    .reg .b32 t, size;
    .reg .b64 a, e;
    mov.u32 t, %tid.x;
    setp.lt.u32 p, t, $3;
    cvt.u64.u32 a, t;
    mad.lo.u64 a, a, $2, $1;
    cvt.u64.u32 e, $4;
    add.u64 e, e, a;
    add.u64 e, e, 15;
    and.b64 e, e, -16;
    and.b64 a, a, -16;
    sub.u64 e, e, a;
    cvt.u32.u64 size, e;
    setp.ne.and.u32 p, size, 0, p;
    @p cp.async.bulk.prefetch.L2.global [a], size;
    mov.u32 $0, 0;
    }""")


@triton.jit
def _prefetch_rows_l2(first, stride_bytes, num_rows, num_bytes):
    """Ask L2 for num_bytes at `first` (a pointer) and at every stride_bytes after it, num_rows rows (at most
    one a thread: rows past the thread count are left out). A hint: nothing waits for it."""
    tl.inline_asm_elementwise(_PREFETCH_ROWS_PTX, "=r,l,l,r,r",
                              [first.to(tl.int64), stride_bytes.to(tl.int64), num_rows.to(tl.int32),
                               num_bytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


EARLY_DEFAULTS = {"EARLY_L2_MB": 0.0, "EARLY_REGS": 0}
EARLY_ON_MB = 16.0  # the L2 budget of DFLASH2_GEMV_EARLY=l2
_EARLY_MODE = os.environ.get("DFLASH2_GEMV_EARLY", "1")  # 1: configs and defaults; 0: off; l2; regs
_EARLY_MB = os.environ.get("DFLASH2_GEMV_EARLY_MB")
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def early_settings(config: dict[str, Any]) -> tuple[float, bool]:
    """(L2 budget in MiB, early register loads) for a launch with this config (see the module docstring)."""
    if _EARLY_MODE not in ("0", "1", "l2", "regs"):
        raise ValueError(f"DFLASH2_GEMV_EARLY must be 0, 1, l2 or regs, got {_EARLY_MODE!r}")
    budget = float(config.get("EARLY_L2_MB", EARLY_DEFAULTS["EARLY_L2_MB"]))
    if _EARLY_MODE == "l2" and not budget:
        budget = EARLY_ON_MB
    if _EARLY_MB is not None and (budget or _EARLY_MODE == "l2"):
        budget = float(_EARLY_MB)
    regs = bool(config.get("EARLY_REGS", EARLY_DEFAULTS["EARLY_REGS"])) or _EARLY_MODE == "regs"
    return (0.0 if _EARLY_MODE in ("0", "regs") or _INTERPRETED else budget), regs and _EARLY_MODE in ("1", "regs")


def early_row_bytes(budget_mb: float, row_bytes: int, programs: int, rows_per_program: int, num_warps: int,
                    device: torch.device) -> int:
    """Bytes of each row's K range a program asks L2 for: all row_bytes if the programs that can be resident
    at once (at most 64 warps and 32 programs an SM) fit budget_mb together, else their equal share in whole
    128-byte lines; 0 with no budget."""
    if budget_mb <= 0 or row_bytes <= 0:
        return 0
    resident = min(programs, _sm_count(device) * min(32, max(1, 64 // num_warps)))
    share = int(budget_mb * (1 << 20) / (resident * rows_per_program)) // 128 * 128
    return min(row_bytes, share)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 tickets for split-K (each tile's last program resets its own). Allocated outside any
    graph capture: the first call with a new size should run eagerly (warm-up) before capturing."""
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
