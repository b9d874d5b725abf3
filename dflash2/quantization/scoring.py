"""Run a loaded model over one whole token sequence, outside the engine, for calibration and validation.

The model's forward takes an attention backend in its context; `DenseCausalAttention` ignores the paged
cache and attends causally over the sequence itself, so no pages, pool or scheduler are involved. With a
quantized KV dtype it reads K and V through the cache format's own quantize -> dequantize
(kernels/torch_ref/kv_quant.py, the functions TorchAttention writes and reads pages with): the engine
writes every token's K/V before attending and reads all of them back from the pages, so this is the same
arithmetic as the engine's KV path, without the pages.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.engine.kv.layout import KV_FORMATS
from dflash2.kernels.torch_ref.kv_quant import QMAX, fake_quantize_kv
from dflash2.models.llama import ForwardContext


class DenseCausalAttention:
    name = "dense"

    def __init__(self, kv_cache_dtype: str | None = None) -> None:
        self.kv_cache_dtype = kv_cache_dtype  # None or a float name: K/V as computed; int8/int4/fp8: quantized

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: object, meta: object,
                scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of one sequence -> [T, H, D]."""
        if self.kv_cache_dtype in QMAX:
            k, v = fake_quantize_kv(k, self.kv_cache_dtype), fake_quantize_kv(v, self.kv_cache_dtype)
        elif self.kv_cache_dtype is not None:  # a float cache: the round trip through its dtype
            stored = KV_FORMATS[self.kv_cache_dtype].storage
            k, v = k.to(stored).to(k.dtype), v.to(stored).to(v.dtype)
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(qh, kh.to(q.dtype), vh.to(q.dtype), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)


@torch.inference_mode()
def hidden_states(module: nn.Module, token_ids: Sequence[int], kv_cache_dtype: str | None = None) -> torch.Tensor:
    """Final hidden states [T, hidden] of one sequence (K/V read back as `kv_cache_dtype` stores them)."""
    device = next(module.parameters()).device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    ctx = ForwardContext(positions=torch.arange(len(ids), device=device), attention=None,
                         kv_caches=[None] * len(module.layers),
                         attention_backend=DenseCausalAttention(kv_cache_dtype))
    return module(ids, ctx)


@torch.inference_mode()
def log_probs(module: nn.Module, token_ids: Sequence[int], kv_cache_dtype: str | None = None) -> torch.Tensor:
    """log_softmax of the logits at every position: [T, vocab] float32."""
    return torch.log_softmax(module.compute_logits(hidden_states(module, token_ids, kv_cache_dtype)).float(), dim=-1)


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
