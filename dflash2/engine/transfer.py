"""Host -> device copies that never make the host wait for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which synchronizes with the
stream; going through pinned memory with `non_blocking=True` queues the copy and returns at once (the
caching host allocator keeps the pinned block alive until the copy has run).
"""
from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import torch


_ARRAY_CODES = {torch.long: "q", torch.int32: "i"}


def _pinned(values: Sequence[Any] | Any, dtype: torch.dtype) -> torch.Tensor:
    """`values` in pinned host memory; a flat list of ints goes through a C array (several times faster than
    torch.tensor(list) for the thousands of ints of a step's inputs)."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and isinstance(values, list) and values and isinstance(values[0], int):
        return torch.frombuffer(array.array(code, values), dtype=dtype).pin_memory()
    return torch.tensor(values, dtype=dtype, pin_memory=True)


def to_device(values: Sequence[Any] | Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return _pinned(values, dtype).to(device, non_blocking=True)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_ints_(dest: torch.Tensor, values: list[int]) -> None:
    """dest[:len(values)] = values (an int64 tensor), queued like to_device."""
    if not dest.is_cuda:
        dest[: len(values)] = torch.tensor(values, dtype=torch.long)
        return
    dest[: len(values)].copy_(_pinned(values, torch.long), non_blocking=True)
