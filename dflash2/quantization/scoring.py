"""Run a loaded model over one whole token sequence, outside the engine, for calibration and validation.

The model's forward takes an attention backend in its context; `DenseCausalAttention` ignores the paged
cache and attends causally over the sequence itself, so no pages, pool or scheduler are involved.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.models.llama import ForwardContext


class DenseCausalAttention:
    name = "dense"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: object, v_cache: object,
                meta: object, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of one sequence -> [T, H, D]."""
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qh, kh.to(q.dtype), vh.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)


@torch.inference_mode()
def hidden_states(module: nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Final hidden states [T, hidden] of one sequence."""
    device = next(module.parameters()).device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    ctx = ForwardContext(positions=torch.arange(len(ids), device=device), attention=None,
                         kv_caches=[(None, None)] * len(module.layers), attention_backend=DenseCausalAttention())
    return module(ids, ctx)


@torch.inference_mode()
def log_probs(module: nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """log_softmax of the logits at every position: [T, vocab] float32."""
    return torch.log_softmax(module.compute_logits(hidden_states(module, token_ids)).float(), dim=-1)


def perplexity_and_kl(logprobs: torch.Tensor, token_ids: Sequence[int],
                      reference: torch.Tensor | None = None) -> tuple[float, float | None]:
    """Perplexity of tokens 1.. under `logprobs`, and the mean KL(reference || this) over those positions."""
    targets = torch.tensor(list(token_ids)[1:], dtype=torch.long)
    picked = logprobs[:-1].gather(1, targets[:, None])[:, 0]
    ppl = float(torch.exp(-picked.mean()))
    if reference is None:
        return ppl, None
    kl = F.kl_div(logprobs[:-1], reference[:-1], log_target=True, reduction="none").sum(dim=-1)
    return ppl, float(kl.mean())
