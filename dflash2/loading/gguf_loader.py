"""Read a GGUF checkpoint: the architecture from its metadata, the weights as float32 with Hugging Face names.

    GGUF file --GGUFReader (memory-mapped)--+--> metadata ----------------------------> ModelArchConfig
                                            +--> one tensor --dequantize--> fp32
                                                   --un-permute q/k (llama only)--> (hf_name, tensor)

Weights come out one at a time, so peak memory is one dequantized tensor on top of the mapped file.
Every tensor's type and name is checked when the file is opened, before any weight is yielded.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor

from dflash2.config import ModelArchConfig, RopeConfig

SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)

# GGUF `general.architecture` -> Hugging Face architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# llama.cpp's converter permutes q/k rows for its rotary layout only for these.
_PERMUTED_ARCHITECTURES = ("llama",)

ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFCheckpoint:
    """One GGUF file, opened read-only and memory-mapped.

    `arch_config` is built at construction; `iter_weights()` dequantizes lazily and may be called again.
    Raises ValueError at construction for an unsupported architecture, tensor type or tensor name.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = GGUFReader(path)
        self.gguf_architecture = _gguf_architecture(self._reader)
        _check_tensors(self._reader.tensors)
        self.arch_config = _arch_config(self._reader, self.gguf_architecture)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float32 tensor in HF shape [out_features, in_features]) per weight."""
        unpermute = self.gguf_architecture in _PERMUTED_ARCHITECTURES
        for tensor in self._reader.tensors:
            if tensor.name == ROPE_FREQS_TENSOR:
                continue  # part of the architecture (RopeConfig.freq_factors), not a weight
            hf_name = hf_tensor_name(tensor.name)
            weight = dequantize_tensor(tensor)
            if unpermute:
                weight = self._unpermute_rotary(hf_name, weight)
            yield hf_name, weight

    def _unpermute_rotary(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        if ".self_attn.q_proj." in hf_name:
            return unpermute_rotary(weight, self.arch_config.num_heads)
        if ".self_attn.k_proj." in hf_name:
            return unpermute_rotary(weight, self.arch_config.num_kv_heads)
        return weight


def read_gguf(path: str) -> tuple[ModelArchConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Open a GGUF file; return its architecture and a lazy iterator of (HF name, float32 tensor)."""
    checkpoint = GGUFCheckpoint(path)
    return checkpoint.arch_config, checkpoint.iter_weights()


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name; ValueError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: no Hugging Face name for it")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor with gguf's own routines into a writable float32 torch tensor."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:
        array = array.copy()  # F32 comes back as a view of the read-only memory map
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (works for weights [rows, in] and biases [rows]).

    The converter turned each head's rows from HF's halves layout [x0..x(d/2-1), y0..y(d/2-1)] into
    llama.cpp's interleaved pairs [x0, y0, x1, y1, ...]; this restores the halves.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _gguf_architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _check_tensors(tensors: list[ReaderTensor]) -> None:
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {supported}"
            )
        if tensor.name != ROPE_FREQS_TENSOR:
            hf_tensor_name(tensor.name)


def _arch_config(reader: GGUFReader, arch: str) -> ModelArchConfig:
    """Build the architecture from `{arch}.*` and `tokenizer.ggml.*` metadata and the tensor list."""
    names = {tensor.name for tensor in reader.tensors}
    hidden_size = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden_size,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_required(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=int(head_dim or hidden_size // num_heads),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope_config(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or any(name.endswith(".attn_q.bias") for name in names),
        qk_norm=arch == "qwen3",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
    )


def _rope_config(reader: GGUFReader, arch: str) -> RopeConfig:
    """RoPE from `{arch}.rope.*`; a `rope_freqs.weight` tensor means llama3-style per-frequency divisors."""
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    original_context = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    freq_factors = _rope_freq_factors(reader)
    if freq_factors is not None:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            freq_factors=freq_factors,
            original_max_position_embeddings=original_context,
        )
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    return RopeConfig(
        theta=theta,
        rope_type="default" if scaling_type == "none" else scaling_type,
        factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=original_context,
    )


def _rope_freq_factors(reader: GGUFReader) -> tuple[float, ...] | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return tuple(float(x) for x in dequantize_tensor(tensor).reshape(-1).tolist())
    return None


def _vocab_size(reader: GGUFReader, arch: str) -> int:
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is not None:
        return int(vocab_size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"GGUF file has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    return len(tokens.data)


def _eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    # Chat GGUFs often mark the end-of-turn token separately (llama3's <|eot_id|>); both end generation.
    ids = (_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value
