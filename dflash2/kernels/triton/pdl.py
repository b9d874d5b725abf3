"""Programmatic dependent launch (Hopper+): the next kernel's programs start while this one finishes.

A decode step is a chain of a few hundred small kernels (W2: ~9 a layer); between two of them the device
otherwise drains the first grid, then launches and ramps up the next, a few microseconds each time. A kernel
launched with `launch_pdl=True` may be started by the hardware once every program of the kernel before it
has called `gdc_launch_dependents`; each of our kernels calls `pdl_start(USE_PDL)` first thing, which waits
(`gdc_wait`) until the previous grid has completed and its writes are visible, then lets the next kernel
launch. So no kernel touches memory before its predecessor is done (correctness is unchanged), but launch
and ramp-up overlap the predecessor's tail. Kernels that do not call it (torch's) launch as usual.

On by default on CUDA devices of compute capability 9.0 or newer; `DFLASH2_PDL=0` turns it off; never under
the interpreter. Launchers pass `**pdl_args()` (the kernel's USE_PDL constant and the launch option).

`DFLASH2_PDL_LAUNCH_FIRST=1` (an experiment, not yet measured): each kernel lets the next one launch before it
waits for its predecessor, instead of after. The next grid can then become resident while this one still
runs (once every program of this one has started), so its launch and ramp-up overlap more than the tail.
Still no kernel touches memory before its predecessor is done: the next kernel's own wait is for this one's
completion. No deadlock either: a grid launches only once the grid before it is wholly resident, so the
oldest unfinished grid always runs.
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


PDL_OFF, PDL_WAIT_FIRST, PDL_LAUNCH_FIRST = 0, 1, 2  # USE_PDL's values


@functools.cache
def pdl_args() -> dict:
    """Keyword arguments for a launch of a kernel that calls pdl_start(USE_PDL) (one dict, built once: callers
    splat it and never change it)."""
    if not pdl_enabled():
        return {"USE_PDL": PDL_OFF}
    launch_first = os.environ.get("DFLASH2_PDL_LAUNCH_FIRST", "0") == "1"
    return {"USE_PDL": PDL_LAUNCH_FIRST if launch_first else PDL_WAIT_FIRST, "launch_pdl": True}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (all of it, writes visible), then let the next one launch (USE_PDL 1); or
    let the next one launch first (2, DFLASH2_PDL_LAUNCH_FIRST); nothing (0)."""
    if USE_PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif USE_PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
