"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks num_experts_per_tok experts
per token; each expert is a SwiGLU MLP; their outputs are summed, weighted by the router.

    router:   softmax(x W_router^T) over all experts, in float32 -> top-k -> renormalized (norm_topk_prob)
              -> float32 kept (Mixtral) or cast to the model dtype (the others), as the reference does
    experts:  gate_up [E, 2I, H] (gate rows first, then up), down [E, H, I]: the Hugging Face layout, stacked
    shared:   Qwen2-MoE adds a shared expert, scaled by sigmoid(x W_shared_gate^T)

The CPU path groups the tokens by expert (one sort), so each selected expert's weights are read once per step in
one matmul over its tokens; on CUDA the experts run in one fused Triton kernel pair (kernels/triton/fused_moe.py).
Quantized experts (QuantConfig's `experts` group) are stacked packed tensors (layers/quant_experts.py) that the
kernel reads as they are; on the CPU each selected expert runs on the dense layers' quantized kernels. The router
stays in 16 bits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.config import ModelArchConfig
from dflash2.layers.quant_experts import QuantExperts
from dflash2.quantization.formats import WeightFormat


class Router(nn.Module):
    """The router's gate: a float weight [num_experts, hidden] (kept in 16 bits when the experts are quantized)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int, shared_expert: nn.Module | None = None,
                 formats: tuple[WeightFormat | None, WeightFormat | None] = (None, None)) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.router_weights_float = arch.router_weights_float
        hidden, inter, experts = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
        self.gate = Router(experts, hidden)
        self.experts = Experts(experts, hidden, inter, *formats)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(1, hidden) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for x [T, hidden]."""
        weights_dtype = torch.float32 if self.router_weights_float else x.dtype
        if x.is_cuda:  # one launch (kernels/triton/moe_router.py)
            from dflash2.kernels.triton.moe_router import moe_route

            return moe_route(x, self.gate.weight, self.top_k, self.norm_topk_prob, weights_dtype)
        return torch_route(x, self.gate.weight, self.top_k, self.norm_topk_prob, weights_dtype)

    def fuses_norm(self, rows: int) -> bool:
        """Whether forward(norm=, add_to=) folds the RMSNorm into the router's launch (which hands the normed rows
        to the experts) and the residual add into the experts' down kernel, for `rows` tokens: CUDA, no shared
        expert, the one-launch router with the whole row in one pass, the experts' few-pairs path."""
        if not self.gate.weight.is_cuda or self.shared_expert is not None:
            return False
        from dflash2.kernels.triton import moe_router
        from dflash2.kernels.triton.fused_moe import takes_add_to

        experts = self.experts
        hidden, inter = self.gate.weight.shape[1], experts.intermediate_size
        return (moe_router.fuses_norm(rows, hidden)
                and takes_add_to(experts.num_experts, hidden, inter, experts.bits, rows, self.top_k))

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                add_to: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x; where fuses_norm (LlamaDecoderLayer.fuses_norms), with `norm` and `add_to`
        given: of norm(x), added into add_to, which is returned."""
        if norm is not None or add_to is not None:
            if norm is None or add_to is None or not self.fuses_norm(x.shape[0]):
                raise ValueError(f"this block does not fold a norm and residual add for {x.shape[0]} tokens")
            from dflash2.kernels.triton.moe_router import moe_route_normed

            weights_dtype = torch.float32 if self.router_weights_float else x.dtype
            weights, ids, normed = moe_route_normed(x, self.gate.weight, self.top_k, self.norm_topk_prob,
                                                    weights_dtype, (norm.weight, norm.eps))
            return self.experts(normed, weights, ids, add_to=add_to)
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return out


def torch_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm_topk_prob: bool,
                weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router in torch ops, as the reference computes it: softmax of x gate^T in float32, the top_k, renormalized
    if norm_topk_prob, the weights cast to weights_dtype (the CPU path; the one-launch kernel's reference)."""
    probs = torch.softmax(F.linear(x, gate), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class Experts(nn.Module):
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I]: float parameters, or QuantExperts where a format of 8, 6
    or 4 bits is given (the same for both projections' bit width; the group size fits each row)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 gate_up_format: WeightFormat | None = None, down_format: WeightFormat | None = None) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.bits = 16 if gate_up_format is None else gate_up_format.bits
        if self.bits == 16:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                             requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                          requires_grad=False)
        else:
            self.gate_up_proj = QuantExperts(num_experts, 2 * intermediate_size, hidden_size, gate_up_format)
            self.down_proj = QuantExperts(num_experts, hidden_size, intermediate_size, down_format)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                add_to: torch.Tensor | None = None) -> torch.Tensor:
        """add_to (fused_moe.takes_add_to): the sum is added into that tensor, which is returned; the fused kernels'
        (CUDA, or the CPU under TRITON_INTERPRET=1)."""
        if x.is_cuda or add_to is not None:
            from dflash2.kernels.triton.fused_moe import fused_moe

            weights_in, packed = self.kernel_arguments()
            return fused_moe(x, *weights_in, weights, ids, add_to=add_to, **packed)
        if self.bits == 16:
            return experts_by_group(x, self.gate_up_proj, self.down_proj, weights, ids)
        return experts_by_group(x, self._runtimes(self.gate_up_proj), self._runtimes(self.down_proj), weights, ids)

    def kernel_arguments(self) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """The fused kernel's weights (gate_up, down) and keyword arguments: the packed bytes, scales and zeros
        of quantized experts (their group sizes follow from the scales' shapes)."""
        if self.bits == 16:
            return (self.gate_up_proj, self.down_proj), {}
        gate_up, down = self.gate_up_proj, self.down_proj
        return ((gate_up.qweight, down.qweight),
                {"bits": self.bits, **gate_up.kernel_arguments("gate_up"), **down.kernel_arguments("down")})

    @staticmethod
    def _runtimes(projection: QuantExperts) -> list:
        if projection.runtimes is None:  # not prepared (a test's module): the reference backend's forms
            from dflash2.kernels.dispatch import quant_matmul_backend

            projection.prepare(quant_matmul_backend("torch"), torch.float32)
        return projection.runtimes


def experts_by_group(x: torch.Tensor, w_gate_up: torch.Tensor | Sequence[Any], w_down: torch.Tensor | Sequence[Any],
                     weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], computed expert by expert
    (ascending, each over all its tokens at once) and added into a zero output in x's dtype, as the reference
    does: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] (or, for quantized experts, a runtime weight per
    expert with `.matmul`), weights and ids [T, k]."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(w_gate_up)).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = order[start:start + count]
        start += count
        tokens = rows // k
        gate, up = _project(w_gate_up, expert, x[tokens]).chunk(2, dim=-1)
        y = _project(w_down, expert, F.silu(gate) * up) * flat_weights[rows, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _project(weight: torch.Tensor | Sequence[Any], expert: int, x: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight[expert])
    return weight[expert].matmul(x)
