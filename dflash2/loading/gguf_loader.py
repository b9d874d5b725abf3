"""Read a GGUF checkpoint: the architecture from its metadata, the weights with Hugging Face names.

    GGUF file --GGUFReader (memory-mapped)--+--> metadata ----------------------------> ModelArchConfig
                                            +--> one tensor --dequantize--> fp32
                                                   --un-permute q/k (llama only)--> (hf_name, tensor)
                                            +--> (native path) Q4_0/Q4_1 blocks --repack--> int4 g32 tensors
                                                               Q8_0 --dequantize, requantize per row--> int8

The native path (`native_quant_config`, the loader's default) keeps the block types the engine has kernels for
in their own precision: Q4_0 and Q4_1 are exactly the engine's int4 format with groups of 32 (w = (q - zero) *
scale; Q4_1's w = d * q + m is zero = -m / d), repacked without rounding the codes; Q8_0 becomes int8 with one
scale per row (the engine's int8 format), requantized from its blocks; every other type is dequantized. The float
path dequantizes everything. Weights come out one at a time, so peak memory is one dequantized tensor on top of
the mapped file. Every tensor's type and name is checked when the file is opened, before any weight is yielded.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor

from dflash2.config import ModelArchConfig, RopeConfig
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.formats import SCALE_DTYPE, WeightFormat, pack_int4
from dflash2.quantization.quantize import quantize

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

# The native path: block types run in their own precision, and the bits they become.
NATIVE_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block: the int4 group size
# GGUF tensor kind -> the QuantConfig group it belongs to (layer tensors; token_embd and output separately)
_QUANT_GROUPS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o_proj",
                 "ffn_gate": "ffn", "ffn_up": "ffn", "ffn_down": "ffn"}


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

    def native_quant_config(self) -> QuantConfig | None:
        """The weight formats of the native path: per tensor group (and per layer where layers differ), 4 bits
        where every tensor of the group is Q4_0/Q4_1, 8 where every one is Q8_0, else 16 (dequantized). None
        when nothing is quantized (an F32/F16/BF16 file): the float path."""
        types = {tensor.name: tensor.tensor_type for tensor in self._reader.tensors}

        def bits(names: list[str]) -> int:
            found = {NATIVE_BITS.get(types[name], 16) for name in names if name in types}
            return found.pop() if len(found) == 1 else 16

        embed = bits(["token_embd.weight"])
        lm_head = embed if self.arch_config.tie_word_embeddings else bits(["output.weight"])
        layers = []
        for layer in range(self.arch_config.num_layers):
            kinds: dict[str, list[str]] = {}
            for kind, group in _QUANT_GROUPS.items():
                kinds.setdefault(group, []).append(f"blk.{layer}.{kind}.weight")
            layers.append({group: bits(names) for group, names in kinds.items()})
        base = {group: Counter(layer[group] for layer in layers).most_common(1)[0][0] for group in ("qkv", "o_proj",
                                                                                                  "ffn")}
        overrides = {index: {g: b for g, b in layer.items() if b != base[g]} for index, layer in enumerate(layers)}
        config = QuantConfig.build(16, {"embed": embed, "lm_head": lm_head, **base},
                                   {index: groups for index, groups in overrides.items() if groups},
                                   group_size=BLOCK, source=self.path)
        return config if config.is_quantized else None

    def iter_weights(self, quant: QuantConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, tensor in HF shape [out_features, in_features]) per weight: float32, or with
        `quant` (native_quant_config's) a quantized weight's packed tensors, named `<hf name>.qweight`,
        `.scales`, `.zeros` (formats.py's layouts)."""
        unpermute = self.gguf_architecture in _PERMUTED_ARCHITECTURES
        for tensor in self._reader.tensors:
            if tensor.name == ROPE_FREQS_TENSOR:
                continue  # part of the architecture (RopeConfig.freq_factors), not a weight
            hf_name = hf_tensor_name(tensor.name)
            fmt = None if quant is None else self._native_format(tensor, quant)
            if fmt is None:
                parts = {"": dequantize_tensor(tensor)}
            elif fmt.bits == 4 and tensor.tensor_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
                parts = q4_as_int4(tensor)
            else:  # Q8_0 -> int8 per row (or a type without a kernel, quantized from its float weights)
                parts = quantize(dequantize_tensor(tensor), fmt)
            base = hf_name.rsplit(".", 1)[0]
            for suffix, part in parts.items():
                name = f"{base}.{suffix}" if suffix else hf_name
                yield name, self._unpermute_rotary(hf_name, part) if unpermute else part

    def _native_format(self, tensor: ReaderTensor, quant: QuantConfig) -> WeightFormat | None:
        """The format `quant` gives this tensor: None for a float one (norms, biases, 16-bit groups)."""
        if not tensor.name.endswith(".weight") or len(tensor.shape) != 2:
            return None
        if tensor.name == "token_embd.weight":
            group, layer = "embed", None
        elif tensor.name == "output.weight":
            group, layer = "lm_head", None
        else:
            match = _LAYER_TENSOR.fullmatch(tensor.name)
            if match is None or match.group(2) not in _QUANT_GROUPS:
                return None
            group, layer = _QUANT_GROUPS[match.group(2)], int(match.group(1))
        fmt = quant.format_for(group, int(tensor.shape[0]), layer)
        return None if fmt.bits == 16 else fmt

    def _unpermute_rotary(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        if ".self_attn.q_proj." in hf_name:
            return unpermute_rotary(weight, self.arch_config.num_heads)
        if ".self_attn.k_proj." in hf_name:
            return unpermute_rotary(weight, self.arch_config.num_kv_heads)
        return weight


def q4_as_int4(tensor: ReaderTensor) -> dict[str, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor as the engine's int4 format with groups of 32 (formats.py): the same codes, repacked.

    A block of 32 weights is an f16 scale d (Q4_1: and an f16 minimum m) and 16 bytes, byte j holding code j in
    its low nibble and code j + 16 in its high one. Q4_0: w = d * (q - 8), so zero 8. Q4_1: w = d * q + m, so
    zero -m / d (in f16: off by at most |m| * 2^-11). A block whose d is 0, or so small that -m / d overflows
    f16, holds m everywhere (to within 15 d): it becomes scale m, zero -1 and codes 0.
    """
    rows = int(tensor.shape[1])
    columns = int(tensor.shape[0])
    groups = columns // BLOCK
    with_min = tensor.tensor_type == GGMLQuantizationType.Q4_1
    block_bytes = 20 if with_min else 18
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).view(rows, groups, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(rows, groups).float()
    nibbles = blocks[..., block_bytes - 16:]
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # [rows, groups, 32]: codes 0..15, 16..31
    if not with_min:
        zeros = torch.full_like(d, 8.0)
        return {"qweight": pack_int4(codes.view(rows, columns)), "scales": d.to(SCALE_DTYPE),
                "zeros": zeros.to(SCALE_DTYPE)}
    m = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, groups).float()
    zeros = (-m / torch.where(d == 0, torch.ones_like(d), d)).to(SCALE_DTYPE)
    constant = (d == 0) | ~torch.isfinite(zeros)
    scales = torch.where(constant, m, d)
    zeros = torch.where(constant, torch.full_like(d, -1.0), zeros.float())
    codes = torch.where(constant[..., None], torch.zeros_like(codes), codes)
    return {"qweight": pack_int4(codes.view(rows, columns)), "scales": scales.to(SCALE_DTYPE),
            "zeros": zeros.to(SCALE_DTYPE)}


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
