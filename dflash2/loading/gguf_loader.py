"""Read a GGUF checkpoint: the architecture from its metadata, the weights with Hugging Face names.

    GGUF file --SkimGGUFReader (mmapped)----+--> metadata (gguf_config) ----------------> ModelArchConfig
                                            +--> one tensor --dequantize--> fp32 (stacked gate + up experts: one)
                                                   --un-permute q/k (llama only)--> (hf_name, tensor)
                                            +--> (native path, gguf_native) Q4_0/Q4_1 blocks --repack--> int4 g32
                                                               Q8_0 --dequantize, requantize per row--> int8

The native path (`native_quant_config`, the loader's default) keeps the block types the engine has kernels for
in their own precision; every other type, and every router and stacked expert, is dequantized. The float path
dequantizes everything. Weights come out one at a time, so peak memory is one dequantized tensor (a layer's
stacked gate and up experts: both, and half of them once more) on top of the mapped file. Every tensor's type and
name is checked when the file is opened, before any weight is yielded.

Mixtures of experts: Mixtral (a `llama` file with `llama.expert_count`), qwen2moe, qwen3moe and olmoe files with
llama.cpp's stacked experts (`blk.N.ffn_{gate,up,down}_exps`); gguf_tensors maps their names.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType

from dflash2.config import ModelArchConfig
from dflash2.loading.gguf_config import GGUF_ARCHITECTURES, arch_config, gguf_architecture
from dflash2.loading.gguf_native import BLOCK, NATIVE_BITS, native_format, native_quant_config, q4_as_int4
from dflash2.loading.gguf_reader import SkimGGUFReader
from dflash2.loading.gguf_tensors import (
    PERMUTED_ARCHITECTURES,
    ROPE_FREQS_TENSOR,
    SUPPORTED_TENSOR_TYPES,
    check_tensors,
    dequantize_tensor,
    gate_up_experts,
    hf_tensor_name,
    is_up_experts,
    unpermute_rotary,
)
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.quantize import quantize

__all__ = ["BLOCK", "GGUF_ARCHITECTURES", "GGUFCheckpoint", "NATIVE_BITS", "ROPE_FREQS_TENSOR",
           "SUPPORTED_TENSOR_TYPES", "dequantize_tensor", "hf_tensor_name", "q4_as_int4", "read_gguf",
           "unpermute_rotary"]


class GGUFCheckpoint:
    """One GGUF file, opened read-only and memory-mapped.

    `arch_config` is built at construction; `iter_weights()` dequantizes lazily and may be called again.
    Raises ValueError at construction for an unsupported architecture, tensor type or tensor name.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = SkimGGUFReader(path)
        self.gguf_architecture = gguf_architecture(self._reader)
        check_tensors(self._reader.tensors)
        self.arch_config = arch_config(self._reader, self.gguf_architecture)

    def native_quant_config(self) -> QuantConfig | None:
        """The weight formats of the native path (gguf_native.native_quant_config); None: the float path."""
        return native_quant_config(self._reader.tensors, self.arch_config, self.path)

    def iter_weights(self, quant: QuantConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, tensor in HF shape [out_features, in_features]) per weight: float32, or with
        `quant` (native_quant_config's) a quantized weight's packed tensors, named `<hf name>.qweight`,
        `.scales`, `.zeros` (formats.py's layouts). A layer's stacked experts come as transformers 5 holds them:
        `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""
        tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        for tensor in self._reader.tensors:
            if tensor.name == ROPE_FREQS_TENSOR or is_up_experts(tensor.name):
                continue  # rope_freqs is part of the architecture (RopeConfig.freq_factors); up goes with gate
            hf_name = hf_tensor_name(tensor.name)
            fmt = None if quant is None else native_format(tensor, quant)
            if tensor.name.endswith(".ffn_gate_exps.weight"):
                parts = {"": gate_up_experts(tensor, tensors[tensor.name.replace("_gate_exps", "_up_exps")])}
            elif fmt is None:
                parts = {"": dequantize_tensor(tensor)}
            elif fmt.bits == 4 and tensor.tensor_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
                parts = q4_as_int4(tensor)
            else:  # Q8_0 -> int8 per row (or a type without a kernel, quantized from its float weights)
                parts = quantize(dequantize_tensor(tensor), fmt)
            base = hf_name.rsplit(".", 1)[0]
            for suffix, part in parts.items():
                name = f"{base}.{suffix}" if suffix else hf_name
                yield name, self._hf_layout(hf_name, part)

    def _hf_layout(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        """A tensor in the layout its Hugging Face name has: q/k rows un-permuted (llama), the shared expert's
        gate [1, H] (llama.cpp's model reads it as a vector)."""
        if self.gguf_architecture in PERMUTED_ARCHITECTURES:
            if ".self_attn.q_proj." in hf_name:
                return unpermute_rotary(weight, self.arch_config.num_heads)
            if ".self_attn.k_proj." in hf_name:
                return unpermute_rotary(weight, self.arch_config.num_kv_heads)
        if hf_name.endswith(".mlp.shared_expert_gate.weight"):
            return weight.reshape(1, -1)
        return weight


def read_gguf(path: str) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Open a GGUF file; return its architecture and a lazy iterator of (HF name, float32 tensor)."""
    checkpoint = GGUFCheckpoint(path)
    return checkpoint.arch_config, checkpoint.iter_weights()
