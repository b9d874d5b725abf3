"""The one-launch MoE router (kernels/triton/moe_router.py) under TRITON_INTERPRET=1 on the CPU, against
SparseMoeBlock.route's torch path on the same x and gate, in float32 (the interpreter's bf16 rounding truncates):
the same experts in the same order, weights equal to float32 rounding."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.kernels.triton import moe_router  # noqa: E402
from dflash2.kernels.triton.gemv_parts import split_counters  # noqa: E402
from dflash2.models.moe import torch_route  # noqa: E402


@pytest.mark.parametrize("num_tokens, num_experts, top_k, norm, hidden", [
    (1, 128, 8, True, 320),    # Qwen3-MoE's router shape, scaled: 16 programs a token (8 experts each), a ticket
    (3, 60, 4, False, 64),     # Qwen1.5-MoE: E not a power of two (the padded experts never picked), no renorm
    (2, 60, 4, True, 1024),    # ... with a ticket: 15 programs of 4 experts, the workspace's last 4 never written
    (1, 8, 2, True, 5000),     # hidden past TILE: two passes of 4,096, a program an expert
    (4, 16, 1, True, 64),      # top-1 (slots padded to two)
    (5, 8, 2, True, 96),       # Mixtral: one program a token, no ticket
    (20, 64, 8, False, 64),    # past FUSED_MAX_TOKENS: F.linear's logits, a program a token selects
])
def test_router_kernel_picks_the_references_experts_with_its_weights(num_tokens, num_experts, top_k, norm, hidden):
    g = torch.Generator().manual_seed(num_experts)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate = torch.randn(num_experts, hidden, generator=g) * 0.2
    weights, ids = moe_router.moe_route(x, gate, top_k, norm, torch.float32)
    ref_weights, ref_ids = torch_route(x, gate, top_k, norm, torch.float32)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)
    assert not split_counters(x.device, num_tokens)[:num_tokens].any()  # the tickets are back at zero


def test_equal_probs_go_to_the_lower_expert():
    x = torch.ones(1, 16)
    gate = torch.zeros(12, 16)
    gate[[2, 5, 9]] = 1.0  # three equal largest logits; two are taken
    weights, ids = moe_router.moe_route(x, gate, 2, True, torch.float32)
    assert ids.tolist() == [[2, 5]]
    assert weights.tolist() == [[0.5, 0.5]]


def test_weights_come_in_the_asked_dtype():
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    gate = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    weights, _ = moe_router.moe_route(x, gate, 4, True, torch.float16)
    ref, _ = torch_route(x, gate, 4, True, torch.float32)
    assert weights.dtype == torch.float16 and torch.equal(weights, ref.to(torch.float16))


def test_a_gate_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="gate"):
        moe_router.moe_route(torch.zeros(1, 32), torch.zeros(8, 16), 2, True, torch.float32)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden", [
    (1, 128, 8, 320),   # 16 programs a token: the first stores the normed row
    (3, 8, 2, 96),      # one program a token
])
def test_router_folds_the_rms_norm(num_tokens, num_experts, top_k, hidden):
    """moe_route_normed: the router of RMSNorm(x) in one launch, which also hands back the normed rows (x, the
    residual stream, unchanged); against RMSNorm then the torch route."""
    from dflash2.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    gate = torch.randn(num_experts, hidden, generator=g) * 0.2
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.rand(hidden, generator=g) + 0.5
    kept = x.clone()
    assert moe_router.fuses_norm(num_tokens, hidden)
    weights, ids, normed = moe_router.moe_route_normed(x, gate, top_k, True, torch.float32, (norm.weight, norm.eps))
    assert torch.equal(x, kept)
    torch.testing.assert_close(normed, norm(x), rtol=2e-6, atol=1e-6)
    ref_weights, ref_ids = torch_route(norm(x), gate, top_k, True, torch.float32)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-5, atol=1e-6)


def test_router_norm_only_where_it_folds():
    """More tokens than the one-launch router takes, or a row past one pass, keep the separate norm: refused."""
    assert not moe_router.fuses_norm(moe_router.FUSED_MAX_TOKENS + 1, 64)
    assert not moe_router.fuses_norm(1, moe_router.TILE + 1)
    weight = torch.ones(64)
    with pytest.raises(ValueError, match="separate norm"):
        moe_router.moe_route_normed(torch.zeros(17, 64), torch.zeros(8, 64), 2, True, torch.float32, (weight, 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        moe_router.moe_route_normed(torch.zeros(1, 64), torch.zeros(8, 64), 2, True, torch.float32,
                                    (weight[:-1], 1e-6))
