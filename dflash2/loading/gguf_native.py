"""The GGUF native path: the block types the engine has kernels for, kept in their own precision.

Q4_0 and Q4_1 are exactly the engine's int4 format with groups of 32 (w = (q - zero) * scale; Q4_1's w = d * q + m
is zero = -m / d), repacked without rounding the codes; Q8_0 becomes int8 with one scale per row (the engine's int8
format), requantized from its blocks; every other type is dequantized. Routers and stacked experts stay float (the
model's experts are 16-bit); a shared expert is an MLP like a dense layer's and follows the `ffn` group.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

from dflash2.config import ModelArchConfig
from dflash2.loading.gguf_tensors import LAYER_TENSOR
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.formats import SCALE_DTYPE, WeightFormat, pack_int4

# The block types run in their own precision, and the bits they become.
NATIVE_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block: the int4 group size
# GGUF tensor kind -> the QuantConfig group it belongs to (layer tensors; token_embd and output separately)
QUANT_GROUPS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o_proj",
                "ffn_gate": "ffn", "ffn_up": "ffn", "ffn_down": "ffn",
                "ffn_gate_shexp": "ffn", "ffn_up_shexp": "ffn", "ffn_down_shexp": "ffn"}


def native_quant_config(tensors: list[ReaderTensor], arch: ModelArchConfig, source: str) -> QuantConfig | None:
    """The weight formats of the native path: per tensor group (and per layer where layers differ), 4 bits where
    every tensor of the group is Q4_0/Q4_1, 8 where every one is Q8_0, else 16 (dequantized). None when nothing
    is quantized (an F32/F16/BF16 file): the float path."""
    types = {tensor.name: tensor.tensor_type for tensor in tensors}

    def bits(names: list[str]) -> int | None:  # None: the file has none of them (a sparse layer's ffn)
        found = {NATIVE_BITS.get(types[name], 16) for name in names if name in types}
        return (found.pop() if len(found) == 1 else 16) if found else None

    embed = bits(["token_embd.weight"]) or 16
    lm_head = embed if arch.tie_word_embeddings else bits(["output.weight"]) or 16
    layers = []
    for layer in range(arch.num_layers):
        kinds: dict[str, list[str]] = {}
        for kind, group in QUANT_GROUPS.items():
            kinds.setdefault(group, []).append(f"blk.{layer}.{kind}.weight")
        layers.append({group: found for group, names in kinds.items() if (found := bits(names)) is not None})
    groups = ("qkv", "o_proj", "ffn")
    base = {group: _most_common([layer[group] for layer in layers if group in layer]) for group in groups}
    overrides = {index: {g: b for g, b in layer.items() if b != base[g]} for index, layer in enumerate(layers)}
    experts = {"experts": 16} if arch.num_experts else {}  # stacked experts are dequantized (gguf_tensors.py)
    config = QuantConfig.build(16, {"embed": embed, "lm_head": lm_head, **base, **experts},
                               {index: groups for index, groups in overrides.items() if groups},
                               group_size=BLOCK, source=source)
    return config if config.is_quantized else None


def _most_common(bits: list[int]) -> int:
    return Counter(bits).most_common(1)[0][0] if bits else 16


def native_format(tensor: ReaderTensor, quant: QuantConfig) -> WeightFormat | None:
    """The format `quant` gives this tensor: None for a float one (norms, biases, routers, stacked experts,
    16-bit groups)."""
    if not tensor.name.endswith(".weight") or len(tensor.shape) != 2:
        return None
    if tensor.name == "token_embd.weight":
        group, layer = "embed", None
    elif tensor.name == "output.weight":
        group, layer = "lm_head", None
    else:
        match = LAYER_TENSOR.fullmatch(tensor.name)
        if match is None or match.group(2) not in QUANT_GROUPS:
            return None
        group, layer = QUANT_GROUPS[match.group(2)], int(match.group(1))
    fmt = quant.format_for(group, int(tensor.shape[0]), layer)
    return None if fmt.bits == 16 else fmt


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
