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


def to_device(values: Sequence[Any] | Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_ints_(dest: torch.Tensor, values: list[int]) -> None:
    """dest[:len(values)] = values (an int64 tensor), queued: the list goes to a pinned buffer through a C array
    (several times faster than torch.tensor(list) for the thousands of ints of a graph step's inputs)."""
    staging = torch.frombuffer(array.array("q", values), dtype=torch.long)
    if dest.is_cuda:
        staging = staging.pin_memory()
    dest[: len(values)].copy_(staging, non_blocking=dest.is_cuda)
