"""Programmatic dependent launch (Hopper+): the next kernel's programs start while this one finishes.

A decode step is a chain of a few hundred small kernels (W2: ~9 a layer); between two of them the device
otherwise drains the first grid, then launches and ramps up the next, a few microseconds each time. A kernel
launched with `launch_pdl=True` may be started by the hardware once every program of the kernel before it
has called `gdc_launch_dependents`; each of our kernels calls `pdl_start(USE_PDL)` before it touches anything
the kernel before it may write; it waits (`gdc_wait`) until the previous grid has completed and its writes are
visible, then lets the next kernel launch. So correctness is unchanged, but launch and ramp-up overlap the
predecessor's tail. Kernels that do not call it (torch's) launch as usual.

On by default on CUDA devices of compute capability 9.0 or newer; `DFLASH2_PDL=0` turns it off; never under
the interpreter. Launchers pass `**pdl_args()` (the kernel's USE_PDL constant and the launch option).

Letting the next kernel launch before the wait instead of after measured slower (W2 int4 452.2 against 459.0
tok/s, tenth session). What may come before the wait is a read of memory that no kernel of the step writes, or
that only a kernel two or more launches back writes (the wait comes before the trigger, so a kernel starts only
once the one before its predecessor has completed): the int4 GEMV requests its first weights there, the fused
residual add its tile of the residual stream (int4_gemv's out_settled), the KV-write kernels their host-written
indices and the rotary tables (kv_write.py), and decode attention its lengths and slots, the rotary tables and
the new token's page (its ROTARY) and its first KV tile's pages (PAGES_EARLY). A kernel may let the next one
launch later than right after its wait (pdl_wait, then pdl_release): decode attention does, after its partial
is stored, so that the next GEMV's early weight loads do not queue ahead of its own few latency-bound ones.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def pdl_enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DFLASH2_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@functools.cache
def pdl_args() -> dict:
    """Keyword arguments for a launch of a kernel that calls pdl_start(USE_PDL) (one dict, built once: callers
    splat it and never change it)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled() else {"USE_PDL": False}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (all of it, writes visible), then let the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """pdl_start's wait alone, for a kernel that lets the next one launch later (pdl_release)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel launch (after pdl_wait, later than pdl_start would)."""
    if USE_PDL:
        gdc_launch_dependents()
