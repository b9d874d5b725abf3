"""Fused elementwise Triton kernels under TRITON_INTERPRET=1 against plain torch."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from dflash2.kernels.triton import elementwise as ew  # noqa: E402
from dflash2.layers.norm import RMSNorm  # noqa: E402
from dflash2.layers.rotary import RotaryEmbedding, _rotate_half  # noqa: E402
from dflash2.config import RopeConfig  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_rms_norm_with_and_without_residual():
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    torch.testing.assert_close(ew.rms_norm(x, norm.weight, 1e-6), norm(x))
    expected_out, expected_residual = norm(x, residual.clone())
    res = residual.clone()
    got = ew.rms_norm(x, norm.weight, 1e-6, res)
    torch.testing.assert_close(res, expected_residual)
    torch.testing.assert_close(got, expected_out)


def test_qk_rms_norm_in_place_on_strided_views():
    heads, kv_heads, dim = 3, 2, 16
    q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(dim), torch.randn(dim)
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(4, heads, dim), k.view(4, kv_heads, dim)
    expected_q, expected_k, v_before = q_norm(q.clone()), k_norm(k.clone()), v.clone()
    ew.qk_rms_norm_(q, k, q_norm.weight, k_norm.weight, 1e-6)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(v, v_before)


def test_rotary_in_place_matches_rotate_half():
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 64)
    qkv = torch.randn(6, (4 + 2 + 2) * 16)
    q, k = qkv[:, :64].view(6, 4, 16), qkv[:, 64:96].view(6, 2, 16)
    positions = torch.tensor([0, 3, 9, 17, 40, 63])
    cos, sin = rotary.cos[positions][:, None, :], rotary.sin[positions][:, None, :]
    expected_q, expected_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    ew.rotary_in_place(q, k, rotary.cos, rotary.sin, positions)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)


def test_silu_and_mul():
    x = torch.randn(3, 2 * 1500)
    torch.testing.assert_close(ew.silu_and_mul(x), F.silu(x[:, :1500]) * x[:, 1500:])
