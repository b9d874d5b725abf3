"""The L2 prefetch ahead of decode GEMVs (kernels/triton/l2_prefetch.py): its settings, the byte ranges it asks
for, the tensors each layer offers, and the kernel's code for sm_90 (compiled here, no GPU needed)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from dflash2.kernels.triton import l2_prefetch


@pytest.fixture(autouse=True)
def fresh_settings():
    caches = (l2_prefetch.prefetch_mode, l2_prefetch.prefetch_groups, l2_prefetch.prefetch_cap_bytes)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def test_off_by_default_and_off_without_a_gpu(monkeypatch):
    monkeypatch.delenv("DFLASH2_L2_PREFETCH", raising=False)
    assert l2_prefetch.prefetch_mode() == ""
    l2_prefetch.prefetch_mode.cache_clear()
    monkeypatch.setenv("DFLASH2_L2_PREFETCH", "side")
    assert l2_prefetch.prefetch_mode() == ("side" if torch.cuda.is_available() and
                                           torch.cuda.get_device_capability()[0] >= 9 else "")


def test_bad_settings_are_errors_that_name_the_choices(monkeypatch):
    monkeypatch.setenv("DFLASH2_L2_PREFETCH", "always")
    with pytest.raises(ValueError, match="inline or side, got 'always'"):
        l2_prefetch.prefetch_mode()
    monkeypatch.setenv("DFLASH2_L2_PREFETCH_SET", "qkv,mlp")
    with pytest.raises(ValueError, match=r"unknown \['mlp'\]; known: qkv, o_proj, gate_up, down, lm_head"):
        l2_prefetch.prefetch_groups()


def test_groups_and_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH2_L2_PREFETCH_SET", " qkv , o_proj")
    monkeypatch.setenv("DFLASH2_L2_PREFETCH_MB", "1.5")
    assert l2_prefetch.prefetch_groups() == {"qkv", "o_proj"}
    assert l2_prefetch.prefetch_cap_bytes() == 3 << 19


def test_ranges_take_the_first_tensor_first_up_to_the_cap():
    big, small = torch.zeros(1000, dtype=torch.int32), torch.zeros(10, dtype=torch.int16)
    assert l2_prefetch._ranges([big, small], 1 << 20) == [(big.data_ptr(), 4000), (small.data_ptr(), 20)]
    assert l2_prefetch._ranges([big, small], 4010) == [(big.data_ptr(), 4000)]  # 10 bytes left: under 16
    assert l2_prefetch._ranges([big, small], 3000) == [(big.data_ptr(), 3000)]


def test_each_layer_offers_the_tensors_its_decode_matmul_reads():
    from dflash2.kernels.triton.quant_matmul import TritonQuantMatmul
    from dflash2.layers.linear import Linear, weight_tensors
    from dflash2.layers.quant_linear import QuantLinear
    from dflash2.quantization.formats import WeightFormat
    from dflash2.quantization.quantize import quantize

    plain = Linear(64, 32)
    assert weight_tensors(plain) == [plain.weight]
    for bits, names in ((8, ("w", "scales")), (6, ("w", "hi"))):
        fmt = WeightFormat(bits, None if bits == 8 else 32)
        layer = QuantLinear(64, 32, fmt)
        assert weight_tensors(layer) == []  # not prepared: nothing to prefetch
        layer.set_packed(quantize(torch.randn(32, 64), fmt))
        layer.prepare(TritonQuantMatmul(), torch.float32)
        assert [t.data_ptr() for t in weight_tensors(layer)] == [layer.runtime.weight[n].data_ptr() for n in names]


def test_the_kernel_compiles_to_bulk_l2_prefetches_for_sm90():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from sass_count import compile_sm90, cuobjdump

    types = {"a_addr": "i64", "a_bytes": "i64", "a_pieces": "i32", "b_addr": "i64", "b_bytes": "i32"}
    for use_pdl in (0, 1):
        compiled = compile_sm90(l2_prefetch._l2_prefetch_kernel, types,
                                {"PIECE": l2_prefetch.PIECE, "LANES": l2_prefetch.LANES, "USE_PDL": use_pdl}, 1, 1)
        sass = cuobjdump(compiled, "-sass")
        assert "UBLKPF.L2" in sass  # cp.async.bulk.prefetch.L2, once per thread (a loop over the lanes)
        assert ("ACQBULK" in sass) == bool(use_pdl)  # griddepcontrol.wait, with PDL only
