"""Weight formats: bit packing, group-size rules, quantization error, kernels against the dequantized reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels.dispatch import quant_matmul_backend
from dflash2.kernels.torch_ref.quant_matmul import PackedWeight
from dflash2.layers.embedding import QuantEmbedding
from dflash2.layers.quant_linear import QuantLinear
from dflash2.quantization.formats import (WeightFormat, dequantize, pack_int4, pack_int6, resolve_group_size,
                                          unpack_int4, unpack_int6)
from dflash2.quantization.quantize import quantize


def test_int4_pack_unpack_round_trip_is_exact_and_nibble_order_is_documented():
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    assert pack_int4(torch.tensor([[3, 10]])).item() == 3 | (10 << 4)


def test_int6_packs_four_weights_in_three_bytes_exactly():
    q = torch.randint(0, 64, (7, 96), generator=torch.Generator().manual_seed(1))
    packed = pack_int6(q)
    assert packed.shape == (7, 72) and packed.dtype == torch.uint8  # 6 bits a weight
    assert torch.equal(unpack_int6(packed), q.to(torch.uint8))
    word = 1 | (2 << 6) | (3 << 12) | (63 << 18)
    assert pack_int6(torch.tensor([[1, 2, 3, 63]])).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]


@pytest.mark.parametrize("in_features, expected", [(576, 64), (1536, 128), (96, 32), (256, 128), (64, 64)])
def test_default_group_size_is_the_largest_of_128_64_32_dividing_the_row(in_features, expected):
    assert resolve_group_size(in_features, None) == expected


def test_group_size_errors_are_clear():
    with pytest.raises(ValueError, match="no group size of 128, 64, 32 divides the row of 48"):
        resolve_group_size(48, None)
    with pytest.raises(ValueError, match="group size 128 does not divide the row of 576"):
        resolve_group_size(576, 128)
    with pytest.raises(ValueError, match="group size 100 is not supported"):
        resolve_group_size(600, 100)
    with pytest.raises(ValueError, match="unsupported bit width 3"):
        WeightFormat(3)


def _weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, 3] = 0.9  # an outlier
    return w


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_round_to_nearest_error_is_within_half_a_step(bits):
    w = _weight()
    fmt = WeightFormat(bits, 32 if bits != 8 else None)
    tensors = quantize(w, fmt)
    shapes = fmt.tensor_shapes(*w.shape)
    assert {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()} == shapes
    err = (dequantize(fmt, tensors) - w).abs()
    if bits == 8:
        assert bool((err <= tensors["scales"].float()[:, None] / 2 + 1e-6).all())
    else:
        step = tensors["scales"].float().repeat_interleave(32, dim=1)
        assert bool((err <= step * 0.51 + 1e-6).all())  # the f16 zero point may move the grid a little


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_calibrated_clipping_never_loses_to_rtn_on_the_weighted_error(bits):
    w = _weight(seed=2)
    importance = torch.rand(128, generator=torch.Generator().manual_seed(3)) ** 4 * 10
    fmt = WeightFormat(bits, 32 if bits != 8 else None)

    def weighted_error(tensors):
        return float((((dequantize(fmt, tensors) - w) ** 2) * importance).sum())

    assert weighted_error(quantize(w, fmt, importance)) <= weighted_error(quantize(w, fmt)) * (1 + 1e-6)


FORMATS = [WeightFormat(16), WeightFormat(8), WeightFormat(6, 32), WeightFormat(4, 32), WeightFormat(4, 64),
           WeightFormat(6, 128)]


@pytest.mark.parametrize("backend", ["torch", "torch_cpu"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_quant_linear_matches_the_dequantized_reference(backend, fmt, rows):
    out_features, in_features = 48, 128
    layer = QuantLinear(in_features, out_features, fmt, bias=True)
    layer.set_packed(quantize(_weight(out_features, in_features, seed=4), fmt))
    layer.bias.data.copy_(torch.randn(out_features))
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(5))
    reference = F.linear(x, layer.dequantized(), layer.bias)
    layer.prepare(quant_matmul_backend(backend), torch.float32)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    tolerance = 1e-5 if backend == "torch" else 2e-2  # torch_cpu runs bf16 activations
    assert torch.allclose(out, reference, atol=tolerance * reference.abs().max(), rtol=0)


def test_cpu_backend_uses_the_int4_kernel_and_falls_back_where_it_cannot():
    backend = quant_matmul_backend("torch_cpu")
    fits = PackedWeight(WeightFormat(4, 32), 48, 128, quantize(_weight(48, 128), WeightFormat(4, 32)))
    odd = PackedWeight(WeightFormat(4, 32), 40, 128, quantize(_weight(40, 128), WeightFormat(4, 32)))
    assert "int4pack" in backend.prepare(fits, torch.float32).kernel
    assert "F.linear" in backend.prepare(odd, torch.float32).kernel
    assert "2 x" in backend.prepare(PackedWeight(WeightFormat(6, 32), 48, 128, quantize(_weight(48, 128),
                                                 WeightFormat(6, 32))), torch.float32).kernel


@pytest.mark.parametrize("in_features", [24, 40, 72])
def test_cpu_backend_runs_int8_rows_of_no_multiple_of_16_without_its_kernel(in_features):
    # torch 2.13's _weight_int8pack_mm reads past such rows: wrong sums, NaN or a segfault (a tensor-parallel
    # shard of a tiny model's 48-wide shared expert is 24 wide)
    backend = quant_matmul_backend("torch_cpu")
    fmt = WeightFormat(8)
    weight = PackedWeight(fmt, 64, in_features, quantize(_weight(64, in_features, seed=7), fmt))
    runtime = backend.prepare(weight, torch.float32)
    assert "int8pack" not in runtime.kernel
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    reference = x.float() @ dequantize(fmt, weight.tensors, torch.float32).t()
    assert torch.allclose(runtime.matmul(x).float(), reference, atol=2e-2 * reference.abs().max(), rtol=0)


@pytest.mark.parametrize("fmt", [WeightFormat(16), WeightFormat(8), WeightFormat(6, 32), WeightFormat(4, 64)],
                         ids=lambda f: f.name)
def test_quant_embedding_lookup_and_tied_projection(fmt):
    embedding = QuantEmbedding(num_embeddings=64, embedding_dim=128, fmt=fmt)
    embedding.set_packed(quantize(_weight(64, 128, seed=6), fmt))
    full = embedding.dequantized()
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.allclose(embedding(ids), full[ids], atol=1e-6)
    embedding.prepare(quant_matmul_backend("torch_cpu"), torch.float32)
    hidden = torch.randn(2, 128)
    reference = hidden @ full.t()
    assert torch.allclose(embedding.project(hidden), reference, atol=2e-2 * reference.abs().max())


def test_set_packed_rejects_a_wrong_size():
    layer = QuantLinear(128, 48, WeightFormat(4, 32))
    tensors = quantize(_weight(48, 128), WeightFormat(4, 32))
    tensors["qweight"] = tensors["qweight"][:, :-1]
    with pytest.raises(ValueError, match="qweight: expected"):
        layer.set_packed(tensors)
