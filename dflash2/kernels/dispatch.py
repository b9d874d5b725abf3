"""Pick a kernel backend by a short name. The GPU issue registers Triton backends here."""
from __future__ import annotations

from typing import Any, Callable

from dflash2.kernels.torch_ref.attention import TorchAttention

def _triton_attention() -> Any:
    from dflash2.kernels.triton.attention import TritonAttention  # imports triton only when asked for

    return TritonAttention()


_ATTENTION_BACKENDS: dict[str, Callable[[], Any]] = {"torch": TorchAttention, "triton": _triton_attention}


def register_attention_backend(name: str, factory: Callable[[], Any]) -> None:
    _ATTENTION_BACKENDS[name] = factory


def attention_backend(name: str) -> Any:
    if name not in _ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_ATTENTION_BACKENDS))}")
    return _ATTENTION_BACKENDS[name]()


# -- quantized matmul (see kernels/torch_ref/quant_matmul.py for the interface) ----------------------------
def _quant_matmul_factories() -> dict[str, Callable[[], Any]]:
    from dflash2.kernels.torch_ref.quant_matmul import CPUPackedMatmul, TorchQuantMatmul

    return {"torch": TorchQuantMatmul, "torch_cpu": CPUPackedMatmul}


_QUANT_MATMUL_BACKENDS: dict[str, Callable[[], Any]] = {}
# device type -> backend name chosen by "auto" ("torch" where none is set)
_DEFAULT_QUANT_MATMUL = {"cpu": "torch_cpu"}


def register_quant_matmul_backend(name: str, factory: Callable[[], Any], default_for: str | None = None) -> None:
    _QUANT_MATMUL_BACKENDS[name] = factory
    if default_for is not None:
        _DEFAULT_QUANT_MATMUL[default_for] = name


def quant_matmul_backend(name: str, device_type: str = "cpu") -> Any:
    """A quantized-matmul backend by name; "auto" picks the device's default ("torch" where none is set, or
    where the default cannot be imported, e.g. "triton" without triton installed)."""
    backends = {**_quant_matmul_factories(), **_QUANT_MATMUL_BACKENDS}
    auto = name == "auto"
    if auto:
        name = _DEFAULT_QUANT_MATMUL.get(device_type, "torch")
    if name not in backends:
        raise ValueError(f"unknown quantized matmul backend {name!r}; available: {', '.join(sorted(backends))}")
    try:
        return backends[name]()
    except ImportError:
        if not auto:
            raise
        return backends["torch"]()


def _triton_quant_matmul() -> Any:
    from dflash2.kernels.triton.quant_matmul import TritonQuantMatmul  # imports triton only when asked for

    return TritonQuantMatmul()


register_quant_matmul_backend("triton", _triton_quant_matmul, default_for="cuda")
