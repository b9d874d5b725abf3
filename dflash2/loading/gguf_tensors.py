"""GGUF tensors as Hugging Face ones: names, supported types, float values, and the layouts llama.cpp changes.

    blk.3.attn_q.weight       -> model.layers.3.self_attn.q_proj.weight   (rows un-permuted for `llama`)
    blk.3.ffn_gate_inp.weight -> model.layers.3.mlp.gate.weight           (the router)
    blk.3.ffn_gate_exps.weight [E, I, H] ─┐
    blk.3.ffn_up_exps.weight   [E, I, H] ─┴> model.layers.3.mlp.experts.gate_up_proj [E, 2I, H] (gate rows first)
    blk.3.ffn_down_exps.weight [E, H, I]  -> model.layers.3.mlp.experts.down_proj    [E, H, I]
    blk.3.ffn_{gate,up,down}_shexp.weight -> model.layers.3.mlp.shared_expert.{gate,up,down}_proj.weight
    blk.3.ffn_gate_inp_shexp.weight       -> model.layers.3.mlp.shared_expert_gate.weight [1, H]

The stacked experts keep the names transformers 5 gives them, which the model loads whole.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

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

# llama.cpp's converter permutes q/k rows for its rotary layout only for these.
PERMUTED_ARCHITECTURES = ("llama",)

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
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

# Stacked experts [E, rows, columns] -> the model's stacked parameter (no `.weight`, as transformers 5 names it).
# Gate and up go into one parameter, gate rows first: `ffn_up_exps` is read together with `ffn_gate_exps`.
STACKED_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_up_proj",
    "ffn_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Mixtral GGUFs from before llama.cpp stacked the experts (early 2024): one tensor per expert.
_PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name; ValueError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if _PER_EXPERT_TENSOR.fullmatch(gguf_name):
        raise ValueError(f"GGUF tensor {gguf_name!r} is in the old per-expert Mixtral layout (one tensor per expert, "
                         f"blk.N.ffn_gate.E.weight), which is not supported: convert the model again with a current "
                         f"llama.cpp convert_hf_to_gguf.py, which stacks the experts (blk.N.ffn_gate_exps.weight)")
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match.group(2) in STACKED_EXPERT_NAMES and match.group(3) == "weight":
        return f"model.layers.{match.group(1)}.{STACKED_EXPERT_NAMES[match.group(2)]}"
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: no Hugging Face name for it")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def check_tensors(tensors: list[ReaderTensor]) -> None:
    """ValueError for a tensor of an unsupported type or name, or a layer with only half of its stacked gate/up."""
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    names = {tensor.name for tensor in tensors}
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {supported}"
            )
        if tensor.name != ROPE_FREQS_TENSOR:
            hf_tensor_name(tensor.name)
        for kind, partner in (("ffn_gate_exps", "ffn_up_exps"), ("ffn_up_exps", "ffn_gate_exps")):
            if tensor.name.endswith(f".{kind}.weight") and tensor.name.replace(kind, partner) not in names:
                raise ValueError(f"GGUF tensor {tensor.name!r} has no {tensor.name.replace(kind, partner)!r}: the "
                                 f"experts' gate and up projections come in pairs")


def is_up_experts(gguf_name: str) -> bool:
    """Whether this is a layer's stacked up projections, read together with its gate ones (gate_up_experts)."""
    return gguf_name.endswith(".ffn_up_exps.weight")


def gate_up_experts(gate: ReaderTensor, up: ReaderTensor) -> torch.Tensor:
    """One layer's experts' gate and up projections, [E, I, H] each, as one float32 tensor [E, 2I, H], gate rows
    first. Filled half by half, so at most one dequantized half exists besides the result."""
    num_experts, rows, columns = (int(n) for n in reversed(gate.shape))
    out = torch.empty(num_experts, 2 * rows, columns)
    out[:, :rows] = dequantize_tensor(gate).reshape(num_experts, rows, columns)
    out[:, rows:] = dequantize_tensor(up).reshape(num_experts, rows, columns)
    return out


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
