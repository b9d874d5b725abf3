"""L2 prefetch of the next GEMV's weights while the small kernels before it run (Hopper's bulk prefetch).

A decode step at batch 1 alternates weight-streaming GEMVs with small kernels (norms, rotary, attention)
that leave HBM nearly idle, and each GEMV starts cold: its first bytes arrive a DRAM latency after it starts,
and its last programs trail. `l2_prefetch(tensors)` launches one small kernel whose threads each issue
`cp.async.bulk.prefetch.L2.global` for a piece of the tensors: the copy engine pulls the bytes into L2 while
the kernels in between run, so the GEMV that reads them finds them there. A prefetch is a hint: no thread
waits for it, and nothing is wrong if its lines are gone by the time they are read.

Where the model issues them (models/llama.py, `prefetch_ahead`): after each GEMV is launched, for the next
one (o_proj after qkv, gate_up after o_proj, down after gate_up, the next layer's qkv or lm_head after down),
at most `DFLASH2_L2_PREFETCH_MB` (default 24) of each. Off by default until measured on the GPU:

    DFLASH2_L2_PREFETCH=inline   in the step's own stream (it waits for its predecessor like every kernel)
    DFLASH2_L2_PREFETCH=side     on a side stream forked from the main one (joined at the end of the forward)
    DFLASH2_L2_PREFETCH_SET      which weights (default qkv,o_proj,gate_up,down,lm_head)

Only CUDA devices of compute capability 9.0 or newer, never under the interpreter, and only for decode-sized
batches (the GEMV path).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PIECE = 8192  # bytes one thread asks for
LANES = 32  # threads (pieces) a program
GROUPS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


@functools.cache
def prefetch_mode() -> str:
    """"" (off), "inline" or "side" (see the module doc)."""
    mode = os.environ.get("DFLASH2_L2_PREFETCH", "")
    if mode not in ("", "inline", "side"):
        raise ValueError(f"DFLASH2_L2_PREFETCH must be inline or side, got {mode!r}")
    if not mode or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return ""
    return mode if torch.cuda.get_device_capability()[0] >= 9 else ""


@functools.cache
def prefetch_groups() -> frozenset[str]:
    names = os.environ.get("DFLASH2_L2_PREFETCH_SET", ",".join(GROUPS))
    groups = frozenset(n.strip() for n in names.split(",") if n.strip())
    unknown = groups - set(GROUPS)
    if unknown:
        raise ValueError(f"DFLASH2_L2_PREFETCH_SET: unknown {sorted(unknown)}; known: {', '.join(GROUPS)}")
    return groups


@functools.cache
def prefetch_cap_bytes() -> int:
    return int(float(os.environ.get("DFLASH2_L2_PREFETCH_MB", "24")) * (1 << 20))


@triton.jit
def _l2_prefetch_kernel(a_addr, a_bytes, a_pieces, b_addr, b_bytes, PIECE: tl.constexpr, LANES: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Pieces 0 .. a_pieces - 1 of range a, then those of range b; one bulk prefetch a thread. Then let the
    next kernel launch; program 0 waits for the previous kernel, so that this grid completes after it (the next
    kernel's wait is for this grid only)."""
    piece = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64)
    in_a = piece < a_pieces
    start = tl.where(in_a, piece, piece - a_pieces) * PIECE
    length = tl.where(in_a, a_bytes, b_bytes) - start
    size = (tl.minimum(length, PIECE) & ~15).to(tl.int32)  # whole 16-byte units (a hint: the tail may go)
    addr = tl.where(in_a, a_addr, b_addr) + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        gdc_launch_dependents()
        if tl.program_id(0) == 0:
            gdc_wait()


def _ranges(tensors: list[torch.Tensor], cap: int) -> list[tuple[int, int]]:
    """(address, bytes) of up to two tensors, at most `cap` bytes in all (the first tensor first)."""
    out = []
    for t in tensors[:2]:
        n = min(t.numel() * t.element_size(), cap)
        if n >= 16:
            out.append((t.data_ptr(), n))
            cap -= n
    return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def l2_prefetch(tensors: list[torch.Tensor]) -> None:
    """Ask L2 for (up to the cap of) these device tensors' bytes, in the current mode; nothing when off."""
    mode = prefetch_mode()
    ranges = _ranges([t for t in tensors if t is not None and t.is_cuda], prefetch_cap_bytes()) if mode else []
    if not ranges:
        return
    (a_addr, a_bytes), (b_addr, b_bytes) = ranges[0], ranges[1] if len(ranges) > 1 else (0, 0)
    a_pieces = triton.cdiv(a_bytes, PIECE)
    grid = (triton.cdiv(a_pieces + triton.cdiv(b_bytes, PIECE), LANES),)
    from dflash2.kernels.triton.pdl import pdl_args

    if mode == "side":
        main = torch.cuda.current_stream(tensors[0].device)
        side = side_stream(tensors[0].device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _l2_prefetch_kernel[grid](a_addr, a_bytes, a_pieces, b_addr, b_bytes, PIECE=PIECE, LANES=LANES,
                                      USE_PDL=0, num_warps=1)
        return
    _l2_prefetch_kernel[grid](a_addr, a_bytes, a_pieces, b_addr, b_bytes, PIECE=PIECE, LANES=LANES,
                              num_warps=1, **pdl_args())


def join_side_stream(device: torch.device) -> None:
    """The main stream waits for the side stream's prefetch kernels (before a graph capture ends)."""
    if prefetch_mode() == "side":
        torch.cuda.current_stream(device).wait_stream(side_stream(device))
