"""Pick a kernel backend by a short name. The GPU issue registers Triton backends here."""
from __future__ import annotations

from typing import Any, Callable

from dflash2.kernels.torch_ref.attention import TorchAttention

_ATTENTION_BACKENDS: dict[str, Callable[[], Any]] = {"torch": TorchAttention}


def register_attention_backend(name: str, factory: Callable[[], Any]) -> None:
    _ATTENTION_BACKENDS[name] = factory


def attention_backend(name: str) -> Any:
    if name not in _ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_ATTENTION_BACKENDS))}")
    return _ATTENTION_BACKENDS[name]()
