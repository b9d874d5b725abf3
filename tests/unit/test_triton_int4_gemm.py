"""The int4 prefill GEMM (kernels/triton/int4_gemm.py) under TRITON_INTERPRET=1 on the CPU, against
dequantize() + matmul in float32, and the code-to-float arithmetic it rests on, exactly."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

import triton.language as tl  # noqa: E402

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight  # noqa: E402
from dflash2.kernels.triton import int4_gemm as ig  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.kernels.triton.gemv_parts import split_counters  # noqa: E402
from dflash2.quantization.formats import WeightFormat, dequantize  # noqa: E402
from dflash2.quantization.quantize import quantize  # noqa: E402


def _weight(n: int, k: int, group_size: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    fmt = WeightFormat(4, group_size)
    return PackedWeight(fmt, n, k, quantize(torch.randn(n, k, generator=g) * 0.05, fmt))


@triton.jit
def _code_floats_store(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    ok = idx < n
    f0, f1, f2, f3, f4, f5, f6, f7 = ig._code_floats(tl.load(w_ptr + idx, mask=ok, other=0), False)
    tl.store(out_ptr + idx, f0, mask=ok)
    tl.store(out_ptr + n + idx, f1, mask=ok)
    tl.store(out_ptr + 2 * n + idx, f2, mask=ok)
    tl.store(out_ptr + 3 * n + idx, f3, mask=ok)
    tl.store(out_ptr + 4 * n + idx, f4, mask=ok)
    tl.store(out_ptr + 5 * n + idx, f5, mask=ok)
    tl.store(out_ptr + 6 * n + idx, f6, mask=ok)
    tl.store(out_ptr + 7 * n + idx, f7, mask=ok)


def test_code_floats_are_exact():
    """Code i of a word becomes 1 + q / 16 (even i) or 16 + q / 16 (odd i), exactly, for every code value in
    every position (the interpreter runs the plain-op branch; the GPU tests check the PTX one)."""
    words = []
    for q in range(16):
        for r in range(16):  # every (even, odd) pair of codes in every pair of positions
            words.append(sum((q if i % 2 == 0 else r) << (4 * i) for i in range(8)))
    w = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)
    out = torch.empty(8, w.numel(), dtype=torch.float32)
    _code_floats_store[(1,)](w, out, w.numel(), BLOCK=triton.next_power_of_2(w.numel()))
    q = torch.tensor([q for q in range(16) for _ in range(16)], dtype=torch.float32)
    r = torch.tensor([r for _ in range(16) for r in range(16)], dtype=torch.float32)
    for i in range(8):
        assert torch.equal(out[i], 1 + q / 16 if i % 2 == 0 else 16 + r / 16), i


@pytest.mark.parametrize("group_size, k, n, rows, config", [
    (32, 192, 37, 20, {"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}),
    # K = 1.5 tiles (ragged: the last tile's second group masked), split in two, rows past one block
    (64, 192, 37, 150, {"BLOCK_N": 16, "BLOCK_M": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}),
    (128, 256, 40, 9, None),  # the defaults (BLOCK_M down to 16 rows; the split found for the SMs)
    (64, 576, 70, 33, None),  # the bundled model's hidden size at group 64: 4.5 tiles of 128
])
def test_int4_gemm_matches_dequantized_reference(group_size, k, n, rows, config):
    weight = _weight(n, k, group_size, seed=k + rows)
    tensors = qm.device_tensors(weight, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = x @ dequantize(weight.fmt, weight.tensors).T
    first = ig.int4_gemm(x, tensors, config=config)
    torch.testing.assert_close(first, expected, atol=3e-5, rtol=1e-5)
    assert torch.equal(ig.int4_gemm(x, tensors, config=config), first)  # the split's counters reset
    assert not split_counters(x.device, 1).any()


def test_int4_gemm_takes_an_output_and_no_rows():
    weight = _weight(24, 128, 32)
    tensors = qm.device_tensors(weight, torch.float32)
    x = torch.randn(6, 128)
    out = torch.empty(6, 24)
    assert ig.int4_gemm(x, tensors, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, x @ dequantize(weight.fmt, weight.tensors).T, atol=3e-5, rtol=1e-5)
    assert ig.int4_gemm(torch.empty(0, 128), tensors).shape == (0, 24)
    with pytest.raises(ValueError, match="expected x"):
        ig.int4_gemm(torch.randn(6, 64), tensors)
    with pytest.raises(ValueError, match="int32 words"):
        ig.int4_gemm(x, {**tensors, "words": None})


def test_gemm_routes_int4_here(monkeypatch):
    """quant_matmul.gemm sends int4 weights here, as the backend's matmul does above GEMV_MAX_M rows (a [gate |
    up] input multiplied first, by silu_and_mul)."""
    weight = _weight(37, 256, 64)
    tensors = qm.device_tensors(weight, torch.float32)
    x = torch.randn(18, 256)
    expected = x @ dequantize(weight.fmt, weight.tensors).T
    calls = []
    original = ig.int4_gemm
    monkeypatch.setattr(qm, "int4_gemm", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    torch.testing.assert_close(qm.gemm(x, tensors), expected, atol=3e-5, rtol=1e-5)
    assert calls == [1]
    runtime = qm.TritonQuantMatmul().prepare(weight, torch.float32)
    assert "int4 GEMM" in runtime.kernel
    torch.testing.assert_close(runtime.matmul(x), expected, atol=3e-5, rtol=1e-5)
    assert calls == [1, 1]
    gate_up = torch.randn(18, 512)
    silu = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:]
    torch.testing.assert_close(runtime.matmul(gate_up, silu_mul=True), silu @ dequantize(weight.fmt, weight.tensors).T,
                               atol=3e-5, rtol=1e-5)
    assert calls == [1, 1, 1]
    with pytest.raises(ValueError, match="silu_mul"):
        qm.gemm(gate_up, tensors, silu_mul=True)


def test_int4_gemm_config_lookup(tmp_path, monkeypatch):
    """A tune's table (DFLASH2_INT4_GEMM_CONFIGS) wins over SHAPE_CONFIGS and DEFAULT_CONFIG; BLOCK_M follows
    the rows (a power of two, 16 at least, the config's at most)."""
    import json

    from dflash2.kernels.triton.gemv_parts import shape_configs

    assert ig.int4_gemm_config(64, 256, 1000) == ig.DEFAULT_CONFIG
    assert ig.int4_gemm_config(64, 256, 5)["BLOCK_M"] == 16
    assert ig.int4_gemm_config(64, 256, 40)["BLOCK_M"] == 64
    tuned = {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
    path = tmp_path / "int4_gemm.json"
    path.write_text(json.dumps({"64x256": tuned}))
    monkeypatch.setenv("DFLASH2_INT4_GEMM_CONFIGS", str(path))
    shape_configs.cache_clear()
    try:
        assert ig.int4_gemm_config(64, 256, 1000) == tuned
        assert ig.int4_gemm_config(64, 256, 20) == {**tuned, "BLOCK_M": 32}
        assert ig.int4_gemm_config(64, 512, 1000) == ig.DEFAULT_CONFIG
    finally:
        monkeypatch.delenv("DFLASH2_INT4_GEMM_CONFIGS")
        shape_configs.cache_clear()
