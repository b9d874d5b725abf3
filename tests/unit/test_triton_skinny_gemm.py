"""The skinny GEMM (16-bit weights, 5-16 rows) under TRITON_INTERPRET=1 on the CPU, against float32 matmul."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.kernels.triton import skinny_gemm as sg  # noqa: E402

N = 37  # odd: masked rows in the last block


@pytest.mark.parametrize("rows", [2, 11, 16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_skinny_gemm_matches_float32_matmul(rows, split_k):
    """Rows past M and rows of W past N masked, K not a multiple of BLOCK_K, split along K (the last program
    of a tile sums the partials and resets its counter: a second call gives the same result)."""
    g = torch.Generator().manual_seed(rows + 10 * split_k)
    k = 200
    weight = (torch.randn(N, k, generator=g) * 0.1).to(torch.float16)
    x = torch.randn(rows, k, generator=g).to(torch.float16)
    config = {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2, "SPLIT_K": split_k}
    out = torch.empty(rows, N, dtype=torch.float16)
    got = sg.skinny_gemm(x, weight, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    ref = x.float() @ weight.float().T
    assert (got.float() - ref).norm() / ref.norm() < 2e-3
    again = sg.skinny_gemm(x, weight, config=config)
    assert torch.equal(again, got)


def test_skinny_split_k_fills_the_device():
    config = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    # qwen3-0.6b's o_proj: 32 row tiles, 16 K tiles; 132 SMs want ~264 programs: 8 splits (2 tiles each)
    assert sg.skinny_split_k(1024, 2048, config, 132) == 8
    # gate_up: 192 row tiles already; two splits
    assert sg.skinny_split_k(6144, 1024, config, 132) == 2
    # one K tile: no split; a config's own SPLIT_K wins, capped at the K tiles
    assert sg.skinny_split_k(64, 128, config, 132) == 1
    assert sg.skinny_split_k(1024, 2048, {**config, "SPLIT_K": 64}, 132) == 16


def test_skinny_config_covers_only_tuned_shapes(tmp_path, monkeypatch):
    """Shapes the tune found faster than cuBLAS have a config; others get None (cuBLAS);
    a tune's table (DFLASH2_SKINNY_CONFIGS) adds shapes and wins over the built-in one."""
    from dflash2.kernels.triton.gemv_parts import shape_configs

    assert sg.skinny_config(4096, 1024) == sg.SKINNY_SHAPE_CONFIGS[(4096, 1024)]
    assert sg.skinny_config(151936, 1024) is None
    table = tmp_path / "skinny.json"
    table.write_text('{"151936x1024": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}, '
                     '"4096x1024": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}}')
    monkeypatch.setenv("DFLASH2_SKINNY_CONFIGS", str(table))
    shape_configs.cache_clear()
    try:
        assert sg.skinny_config(151936, 1024)["BLOCK_N"] == 64
        assert sg.skinny_config(4096, 1024)["BLOCK_N"] == 16
    finally:
        monkeypatch.delenv("DFLASH2_SKINNY_CONFIGS")
        shape_configs.cache_clear()


def test_skinny_gemm_rejects_what_it_cannot_take():
    weight = torch.zeros(8, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        sg.skinny_gemm(torch.zeros(17, 32, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="16-bit weight"):
        sg.skinny_gemm(torch.zeros(5, 32), weight.float())
    with pytest.raises(ValueError, match="expected x"):
        sg.skinny_gemm(torch.zeros(5, 31, dtype=torch.float16), weight)


@pytest.mark.parametrize("rows", [2, 9, 16])
def test_skinny_silu_out_matches_gemm_then_silu_and_mul(rows):
    """A fused [gate | up] weight: silu(gate) * up of the two products, each rounded to the activations' dtype as
    the unfused GEMM stores it, then rounded as silu_and_mul rounds (the same bits as the GEMM + silu_and_mul)."""
    g = torch.Generator().manual_seed(rows)
    k, half = 96, 40
    weight = (torch.randn(2 * half, k, generator=g) * 0.1).to(torch.float16)
    x = torch.randn(rows, k, generator=g).to(torch.float16)
    config = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    got = sg.skinny_gemm(x, weight, silu_out=True, config=config)
    products = sg.skinny_gemm(x, weight, config={**config, "BLOCK_N": 16, "SPLIT_K": 1})
    gate, up = products[:, :half].float(), products[:, half:]
    expected = (torch.nn.functional.silu(gate).to(torch.float16).float() * up.float()).to(torch.float16)
    assert got.shape == (rows, half)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="silu_out"):
        sg.skinny_gemm(x, weight[:-1], silu_out=True)
