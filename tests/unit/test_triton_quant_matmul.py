"""Triton quantized matmul under TRITON_INTERPRET=1 on the CPU, against dequantize() + matmul in float32."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.kernels.torch_ref.quant_matmul import PackedWeight  # noqa: E402
from dflash2.kernels.triton.gemv_parts import shape_configs  # noqa: E402
from dflash2.kernels.triton import quant_matmul as qm  # noqa: E402
from dflash2.quantization.formats import WeightFormat, dequantize  # noqa: E402
from dflash2.quantization.quantize import quantize  # noqa: E402

N = 37  # odd: masked rows in the last block


def packed(bits: int, group_size: int | None, k: int, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    fmt = WeightFormat(bits, group_size)
    return PackedWeight(fmt, N, k, quantize(torch.randn(N, k, generator=g) * 0.05, fmt))


def expected(x: torch.Tensor, weight: PackedWeight, silu_mul: bool = False) -> torch.Tensor:
    if silu_mul:
        k = weight.in_features
        x = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    return x @ dequantize(weight.fmt, weight.tensors).T


@pytest.mark.parametrize("bits, group_size", [(16, None), (8, None), (4, 32), (4, 64), (4, 128), (6, 32), (6, 64)])
@pytest.mark.parametrize("rows", [1, 3, 18])
def test_backend_matches_dequantized_reference(bits, group_size, rows):
    weight = packed(bits, group_size, 256, seed=bits + rows)
    runtime = qm.TritonQuantMatmul().prepare(weight, torch.float32)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(runtime.matmul(x), expected(x, weight), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bits, group_size", [(16, None), (8, None), (4, 32), (6, 128)])
@pytest.mark.parametrize("rows", [1, 3, 18])
def test_silu_mul_input(bits, group_size, rows):
    weight = packed(bits, group_size, 128)
    runtime = qm.TritonQuantMatmul().prepare(weight, torch.float32)
    x = torch.randn(rows, 256)
    torch.testing.assert_close(runtime.matmul(x, silu_mul=True), expected(x, weight, silu_mul=True),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bits, group_size, k, words", [(16, None, 100, 0), (8, None, 72, 0), (8, None, 96, 1),
                                                         (6, 64, 192, 0)])
def test_gemv_split_k_and_ragged_k(bits, group_size, k, words):
    """Split along K (the last program sums the partials and resets its counter), K not a tile multiple;
    int8 codes read as bytes and as int32 words."""
    weight = packed(bits, group_size, k)
    tensors = qm.device_tensors(weight, torch.float32)
    config = {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1, "WORDS": words}
    for rows in (1, 4):
        x = torch.randn(rows, k)
        first = qm.gemv(x, tensors, config=config)
        torch.testing.assert_close(first, expected(x, weight), atol=2e-5, rtol=1e-5)
        assert torch.equal(qm.gemv(x, tensors, config=config), first)
    assert not qm.split_counters(x.device, 1).any()


@pytest.mark.parametrize("bits, group_size, words", [(8, None, 0), (8, None, 1), (6, 32, 0)])
def test_gemm_many_row_blocks_and_split_k(bits, group_size, words):
    weight = packed(bits, group_size, 192)
    tensors = qm.device_tensors(weight, torch.float32)
    for rows, split in ((20, 3), (150, 1)):
        config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": 4, "num_stages": 1,
                  "WORDS": words}
        x = torch.randn(rows, 192)
        torch.testing.assert_close(qm.gemm(x, tensors, config=config), expected(x, weight), atol=3e-5, rtol=1e-5)


def test_bfloat16_activations():
    weight = packed(4, 32, 128)
    runtime = qm.TritonQuantMatmul().prepare(weight, torch.bfloat16)
    for rows in (1, 20):
        x = torch.randn(rows, 128).bfloat16()
        got = runtime.matmul(x)
        assert got.dtype == torch.bfloat16
        ref = expected(x.float(), weight)
        assert (got.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_16bit(silu_mul, dtype):
    weight = torch.randn(N, 96).to(dtype)
    x = torch.randn(2, 192 if silu_mul else 96).to(dtype)
    act = x.float()
    if silu_mul:  # as silu_and_mul rounds: silu in fp32 -> x's dtype, times up in x's dtype
        act = (torch.nn.functional.silu(act[:, :96]).to(dtype) * x[:, 96:]).float()
    out = torch.empty(2, N, dtype=dtype)
    got = qm.gemv_16bit(x, weight, out=out, silu_mul=silu_mul)
    assert got.data_ptr() == out.data_ptr()
    ref = act @ weight.float().T
    # the interpreter truncates float32 -> bfloat16 (the GPU rounds), hence the loose bound there
    assert (got.float() - ref).norm() / ref.norm() < (1e-6 if dtype == torch.float32 else 2e-2)


def assert_norm_folds(matmul, k: int, g: torch.Generator):
    """matmul(x, norm=(weight, eps)) on a residual stream of 1 and 3 rows: the stream left as it was, the product
    that of RMSNorm(x) (matmul of the separately normed rows); returns the norm."""
    from dflash2.layers.norm import RMSNorm

    norm = RMSNorm(k, 1e-5)
    norm.weight.data = torch.rand(k, generator=g) + 0.5
    for rows in (1, 3):
        residual = torch.randn(rows, k, generator=g) * 3
        kept = residual.clone()
        fused = matmul(residual, norm=(norm.weight, norm.eps))
        assert torch.equal(residual, kept)
        torch.testing.assert_close(fused, matmul(norm(residual)), atol=1e-5, rtol=1e-5)
    return norm


@pytest.mark.parametrize("bits, group_size, k, config", [
    (16, None, 96, {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1}),    # 3 K steps, rstd from a pass over the row
    (16, None, 100, {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 2}),   # ragged K, split: each split norms the row
    (8, None, 64, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1, "WORDS": 1}),
    (6, 32, 64, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1}),
])
def test_gemv_norm_and_residual_add(bits, group_size, k, config):
    """gemv(norm=(weight, eps)): the input is RMSNorm(x) (x the residual stream, left as it was); add_out: out +=
    the product, also with a [gate | up] input. Both against the separate steps, on the same kernel."""
    weight = packed(bits, group_size, k, seed=k)
    tensors = qm.device_tensors(weight, torch.float32)
    config = {"num_warps": 4, "num_stages": 1, **config}
    g = torch.Generator().manual_seed(k)
    norm = assert_norm_folds(lambda x, **kw: qm.gemv(x, tensors, config=config, **kw), k, g)
    for rows in (1, 3):
        for silu_mul in (False, True):
            x = torch.randn(rows, 2 * k if silu_mul else k, generator=g)
            stream = torch.randn(rows, N, generator=g)
            want = stream + qm.gemv(x, tensors, config=config, silu_mul=silu_mul)
            added = qm.gemv(x, tensors, out=stream, config=config, silu_mul=silu_mul, add_out=True)
            assert added.data_ptr() == stream.data_ptr()
            torch.testing.assert_close(stream, want, atol=1e-6, rtol=1e-6)
    assert not qm.split_counters(x.device, 1).any()
    residual = torch.randn(1, k)
    with pytest.raises(ValueError, match="norm weight"):
        qm.gemv(residual, tensors, norm=(norm.weight[:-1], 1e-5))
    with pytest.raises(ValueError, match="add_out"):
        qm.gemv(residual, tensors, add_out=True)
    with pytest.raises(ValueError, match="not both"):
        qm.gemv(torch.randn(1, 2 * k), tensors, silu_mul=True, norm=(norm.weight, norm.eps))


def test_gemv_16bit_norm_bfloat16():
    """The 16-bit GEMV with norm= on bf16 rows against RMSNorm then the plain GEMV (the interpreter truncates
    float32 -> bfloat16 where torch rounds, hence the loose bound; tests/gpu checks the decode step's tokens)."""
    from dflash2.layers.norm import RMSNorm

    weight = torch.randn(N, 64).bfloat16()
    norm = RMSNorm(64, 1e-6).bfloat16()
    norm.weight.data = (torch.rand(64) + 0.5).bfloat16()
    residual = (torch.randn(1, 64) * 4).bfloat16()
    fused = qm.gemv_16bit(residual, weight, norm=(norm.weight, norm.eps))
    separate = qm.gemv_16bit(norm(residual), weight)
    assert fused.dtype == torch.bfloat16
    assert (fused.float() - separate.float()).norm() / separate.float().norm() < 2e-2


def test_int6_planes_hold_the_codes():
    weight = packed(6, 32, 64)
    low, high = qm.int6_planes(weight.tensors["qweight"])
    from dflash2.quantization.formats import unpack_int4, unpack_int6

    codes = unpack_int6(weight.tensors["qweight"])
    high_codes = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)
    assert torch.equal(unpack_int4(low) | (high_codes << 4), codes)


def test_dispatch_picks_triton_on_cuda_only():
    from dflash2.kernels.dispatch import quant_matmul_backend

    assert quant_matmul_backend("auto", "cuda").name == "triton"
    assert quant_matmul_backend("auto", "cpu").name == "torch_cpu"


def _int4_prepared(n: int, k: int, group_size: int, seed: int = 0, half2: bool = False):
    """A random int4 weight and its prepare_int4 tensors (the float32-product layout unless half2)."""
    from dflash2.kernels.triton.int4_gemv import prepare_int4

    g = torch.Generator().manual_seed(seed)
    fmt = WeightFormat(4, group_size)
    weight = PackedWeight(fmt, n, k, quantize(torch.randn(n, k, generator=g) * 0.05, fmt))
    tensors = weight.tensors
    return weight, prepare_int4(tensors["qweight"], tensors["scales"], tensors["zeros"], group_size, half2=half2)


def test_int4_repack_layout():
    """Word j of chunk c holds column 32 c + 4 p + j in slot p, at SLOT_BITS[p] (rotated within 32 bits)."""
    from dflash2.kernels.triton.int4_gemv import SLOT_BITS
    from dflash2.quantization.formats import unpack_int4

    weight, prepared = _int4_prepared(5, 128, 32)
    codes = unpack_int4(weight.tensors["qweight"]).long()  # [N, K]
    words = prepared["words"].long() & 0xFFFFFFFF  # [N, K / 8]
    for p, bit in enumerate(SLOT_BITS):
        rotated = ((words >> bit) | (words << (32 - bit))) & 15  # the slot's 4 bits at the bottom
        got = rotated.reshape(5, 4, 4)  # [N, chunk, j]
        assert torch.equal(got, codes.reshape(5, 4, 8, 4)[:, :, p, :])
    sz = prepared["sz"]
    assert torch.equal(sz.view(torch.float16).reshape(5, 4, 2)[..., 0], weight.tensors["scales"])
    assert torch.equal(sz.view(torch.float16).reshape(5, 4, 2)[..., 1], weight.tensors["zeros"])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("group_size, k, block_n, chunks, split_k", [
    (128, 512, 8, 4, 1),    # K a whole number of steps, N = 37 not of blocks
    (64, 192, 4, 4, 1),     # K not a multiple of the step (2 steps, the second part masked)
    (32, 480, 8, 8, 3),     # split along K, ragged
    (128, 256, 16, 2, 2),   # split along K, even
    (32, 128, 8, 4, 1),     # one step: nothing loaded ahead
    (32, 256, 4, 2, 2),     # split, several steps a split (2: the next one loaded ahead)
])  # K as small as keeps each case's constexprs (EVEN_K, PREFETCH, SPLIT_K): interpreted time grows with the steps
def test_int4_gemv_matches_reference(rows, group_size, k, block_n, chunks, split_k):
    """The int4 decode kernel (repacked words, 1 + q/16 and 16 + q/16 floats, scales outside the slot loop;
    the first step's words loaded before the PDL wait, each next step's a step ahead) for 1..4 activation rows,
    ragged N and K, group sizes 32/64/128, split along K."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    weight, prepared = _int4_prepared(N, k, group_size, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    config = {"BLOCK_N": block_n, "CHUNKS": chunks, "num_warps": 1, "num_stages": 1, "SPLIT_K": split_k}
    got = int4_gemv(x, prepared, config=config)
    torch.testing.assert_close(got, expected(x, weight), atol=2e-5, rtol=1e-5)
    assert torch.equal(int4_gemv(x, prepared, config=config), got)  # the split-K tickets reset themselves
    assert not qm.split_counters(x.device, 1).any()


@pytest.mark.parametrize("half2", [False, True])
@pytest.mark.parametrize("k, chunks, split_k", [(256, 8, 1), (1024, 8, 1), (1024, 8, 2), (384, 4, 4)])
def test_int4_gemv_steps_and_splits(k, chunks, split_k, half2):
    """One step, several (the next one's words loaded ahead, the rows asked of L2 after the wait), split along
    K, with either product layout."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    weight, prepared = _int4_prepared(N, k, 32, seed=k + split_k, half2=half2)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(k))
    config = {"BLOCK_N": 8, "CHUNKS": chunks, "num_warps": 1, "num_stages": 1, "SPLIT_K": split_k}
    got = int4_gemv(x, prepared, config=config)
    torch.testing.assert_close(got, expected(x, weight), atol=3e-3 if half2 else 2e-5, rtol=3e-3 if half2 else 1e-5)


@pytest.mark.parametrize("products", ["float", "half2"])
@pytest.mark.parametrize("rows, k, chunks, programs, mode", [
    (1, 128, 4, 2, "plain"),     # one step a tile: activations loaded once; 5 tiles over 2 programs
    (3, 448, 4, 3, "plain"),     # 4 steps a tile, the last part masked (K not a multiple of the step)
    (4, 256, 2, 5, "plain"),     # as many programs as tiles (one tile each), 2 steps
    (2, 128, 4, 4, "silu_out"),  # paired gate/up rows, silu(gate) * up stored by tile
    (1, 384, 4, 2, "silu_mul"),  # [gate | up] activations, 3 steps
])
def test_int4_gemv_persistent(rows, k, chunks, programs, mode, products):
    """config "PERSISTENT" (fewer programs than row tiles, each walking its tiles with the next step's words
    requested ahead) computes bit for bit what one program a tile does, ragged N and K included."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up

    half2 = products != "float"
    weight, prepared = _int4_prepared(N + 3 if mode == "silu_out" else N, k, 32, seed=rows + k, half2=half2)
    x = torch.randn(rows, 2 * k if mode == "silu_mul" else k, generator=torch.Generator().manual_seed(k))
    config = {"BLOCK_N": 8, "CHUNKS": chunks, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1}
    kwargs = {"silu_out": mode == "silu_out", "silu_mul": mode == "silu_mul"}
    if mode == "silu_out":
        prepared = pair_gate_up(prepared)
    plain = int4_gemv(x, prepared, config=config, **kwargs)
    persistent = {**config, "PERSISTENT": 1, "PROGRAMS": programs}
    assert torch.equal(int4_gemv(x, prepared, config=persistent, **kwargs), plain)
    if mode == "plain":
        torch.testing.assert_close(plain, expected(x, weight), atol=3e-3 if half2 else 2e-5,
                                   rtol=3e-3 if half2 else 1e-5)


@pytest.mark.parametrize("k, config, half2", [
    # both dequant arithmetics on the short cases; each longer case at the least K of its branch (7-9 s each
    # interpreted, 14-17 s at the K of 448-512 they had)
    (128, {"CHUNKS": 4, "SPLIT_K": 1}, False),                     # one step
    (128, {"CHUNKS": 4, "SPLIT_K": 1}, True),
    (192, {"CHUNKS": 4, "SPLIT_K": 1}, False),                     # 2 steps (one loaded ahead), the last part masked
    (256, {"CHUNKS": 4, "SPLIT_K": 2}, True),                      # split along K: each split (a step) norms the
                                                                   # whole row (2 steps)
    (128, {"CHUNKS": 4, "PERSISTENT": 1, "PROGRAMS": 2}, False),   # persistent, one step: normed once a program
    (128, {"CHUNKS": 4, "PERSISTENT": 1, "PROGRAMS": 2}, True),
    (192, {"CHUNKS": 4, "PERSISTENT": 1, "PROGRAMS": 3}, True),    # persistent, 2 steps, the last part masked
])
def test_int4_gemv_norm_and_residual_add(k, config, half2):
    """norm=(weight, eps): the GEMV's input is RMSNorm(x) computed in its prologue (x the residual stream, left
    as it was); add_out: out += the product in the epilogue. Both against the separate steps."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    weight, prepared = _int4_prepared(N, k, 32, seed=k, half2=half2)
    config = {"BLOCK_N": 8, "num_warps": 1, "num_stages": 1, **config}
    g = torch.Generator().manual_seed(k)
    norm = assert_norm_folds(lambda x, **kw: int4_gemv(x, prepared, config=config, **kw), k, g)
    residual = torch.randn(1, k, generator=g)
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=g)
        for settled in (False, True):  # out_settled: the regular kernel reads out before its loop
            stream = torch.randn(rows, N, generator=g)
            want = stream + int4_gemv(x, prepared, config=config)
            added = int4_gemv(x, prepared, out=stream, config=config, add_out=True, out_settled=settled)
            assert added.data_ptr() == stream.data_ptr()
            torch.testing.assert_close(stream, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="norm weight"):
        int4_gemv(residual, prepared, norm=(norm.weight[:-1], 1e-5))
    with pytest.raises(ValueError, match="add_out"):
        int4_gemv(x, prepared, add_out=True)


def test_int4_half2_layout():
    """16-bit models' layout (half2): the same slots (column 32 c + 4 s + j in word j), each at HALF2_SLOT_BITS[s]:
    slots 0/1, 2/3 (and of the word >> 8: 4/5, 6/7) share a LOP3 that makes two fp16 values."""
    from dflash2.kernels.triton.int4_gemv import HALF2_SLOT_BITS
    from dflash2.quantization.formats import unpack_int4

    weight, prepared = _int4_prepared(5, 128, 32, half2=True)
    t = weight.tensors
    assert prepared["half2"]
    codes = unpack_int4(t["qweight"]).long()
    words = prepared["words"].long() & 0xFFFFFFFF
    for s, bit in enumerate(HALF2_SLOT_BITS):
        assert torch.equal(((words >> bit) & 15).reshape(5, 4, 4), codes.reshape(5, 4, 8, 4)[:, :, s, :])


@pytest.mark.parametrize("rows, group_size, k, split_k, paired", [(1, 32, 96, 1, False), (3, 64, 384, 1, False),
                                                                   (4, 128, 256, 2, False), (2, 32, 128, 1, True)])
def test_int4_half2_gemv_matches_reference(rows, group_size, k, split_k, paired):
    """The half2 products (here their interpreter path: the same codes, activations rounded to fp16) against
    dequantize() + matmul; with paired gate/up rows, silu_out too."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up

    weight, prepared = _int4_prepared(N + 1 if paired else N, k, group_size, seed=rows, half2=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    config = {"BLOCK_N": 8, "CHUNKS": 4, "num_warps": 1, "num_stages": 1, "SPLIT_K": split_k}
    want = expected(x, weight)
    if paired:
        prepared = pair_gate_up(prepared)
        half = want.shape[1] // 2
        got = int4_gemv(x, prepared, config=config, silu_out=True)
        want = torch.nn.functional.silu(want[:, :half]) * want[:, half:]
    else:
        got = int4_gemv(x, prepared, config=config)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("rows, split_k", [(1, 1), (3, 2), (4, 1)])
def test_int4_gemv_silu_mul(rows, split_k):
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    weight, prepared = _int4_prepared(N, 384, 128, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(7))
    config = {"BLOCK_N": 8, "CHUNKS": 4, "num_warps": 1, "num_stages": 1, "SPLIT_K": split_k}
    out = torch.empty(rows, N)
    got = int4_gemv(x, prepared, out=out, silu_mul=True, config=config)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected(x, weight, silu_mul=True), atol=2e-5, rtol=1e-5)


def test_int4_gemv_is_the_backend_default():
    """TritonQuantMatmul prepares the repacked copy and runs M <= GEMV_MAX_M through it; the default configs
    run (BLOCK_M 1, 2, 4). Packed fp16 products (half2) for a 16-bit model, float32 products for a float32 one."""
    weight = packed(4, 128, 256)
    runtime = qm.TritonQuantMatmul().prepare(weight, torch.float32)
    assert not runtime.weight["int4"]["half2"]
    assert qm.TritonQuantMatmul().prepare(weight, torch.bfloat16).weight["int4"]["half2"]
    for rows in (1, 2, 4):  # seeded: from the global generator the inputs would depend on the tests run before
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(runtime.matmul(x), expected(x, weight), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, block_n, split_k", [(1, 8, 1), (3, 4, 1), (4, 8, 1), (2, 8, 2)])
def test_int4_gemv_gate_up_pairs(rows, block_n, split_k):
    """A [gate | up] weight with its rows interleaved (pair_gate_up): a plain product comes back in [gate | up]
    order, and silu_out gives silu(gate) * up of it; a split along K falls back to a GEMV and silu_and_mul.
    (float32 here: the interpreter rounds to bf16 unlike the GPU; tests/gpu checks bf16 bit for bit.)"""
    from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up

    def silu_and_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    inter, k = 24, 256
    weight, prepared = _int4_prepared(2 * inter, k, 64, seed=rows)
    paired = pair_gate_up(prepared)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    config = {"BLOCK_N": block_n, "CHUNKS": 4, "num_warps": 1, "num_stages": 1, "SPLIT_K": split_k}
    plain = int4_gemv(x, prepared, config=config)
    assert torch.equal(int4_gemv(x, paired, config=config), plain)
    fused = int4_gemv(x, paired, config=config, silu_out=True)
    assert fused.shape == (rows, inter)
    torch.testing.assert_close(fused, silu_and_mul(plain), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="pair_gate_up"):
        int4_gemv(x, prepared, silu_out=True)


def test_quant_linear_gate_up_applies_silu_in_its_gemv():
    """A gate_up QuantLinear on the Triton backend pairs its int4 rows at prepare and returns silu(gate) * up
    from forward(silu_out=True), equal to the unfused path, for decode rows (GEMV) and prefill rows (GEMM)."""
    from dflash2.layers.linear import silu_and_mul
    from dflash2.layers.quant_linear import QuantLinear

    fmt = WeightFormat(4, 64)
    layer = QuantLinear(256, 48, fmt)
    layer.set_packed(quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * 0.05, fmt))
    plain = QuantLinear(256, 48, fmt)
    plain.set_packed(layer.packed().tensors)
    layer.gate_up = True
    for module in (layer, plain):
        module.prepare(qm.TritonQuantMatmul(), torch.float32)
    assert layer.runtime.fuses_silu_out and not plain.runtime.fuses_silu_out
    for rows in (1, 3, 9):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x, silu_out=True), silu_and_mul(plain(x)), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(layer(x), plain(x), atol=0, rtol=0)


@pytest.mark.slow
def test_decoder_layers_fold_norms_into_int4_gemvs(tmp_path, monkeypatch):
    """A tiny int4 model on the Triton backend (interpreted) whose decode steps fold both RMSNorms and both
    residual adds of every layer into the GEMVs generates the same greedy tokens as with the separate steps
    (fuses_norms patched off); prefill steps (more rows than the GEMV takes) keep them separate. Qwen3, whose q/k
    norms still run after qkv, covers Llama's layer too (the same class; Llama alone doubled the test's 2.5
    minutes under the interpreter)."""
    import dflash2.engine.model_setup as model_setup_module
    from dflash2 import LLM, SamplingParams
    from dflash2.cli.main import main as dflash2_main
    from dflash2.loading.model_loader import load_model
    from dflash2.models.llama import LlamaDecoderLayer
    from tests.tiny_models import build_tiny_model

    source, out = str(tmp_path / "source"), str(tmp_path / "int4")
    build_tiny_model("qwen3", source)
    assert dflash2_main(["convert", "--model-path", source, "--output-path", out, "--dtype", "int4",
                         "--no-progress"]) == 0
    monkeypatch.setattr(model_setup_module, "load_model",
                        lambda *args, **kw: load_model(*args, **{**kw, "quant_backend": "triton"}))
    prompts = [[5, 17, 99, 3, 250, 8], [40, 41, 42]]
    params = SamplingParams(max_tokens=2, min_tokens=2, temperature=0)  # one decode step (~14 s interpreted)
    fuses_norms = LlamaDecoderLayer.fuses_norms
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LlamaDecoderLayer, "fuses_norms", lambda self, rows: False)
        llm = LLM(out, kv_cache_memory="4MiB", max_num_seqs=2)
        layer = llm.engine.model.module.layers[0]
        assert fuses_norms(layer, 1) and not fuses_norms(layer, qm.GEMV_MAX_M + 1)
        runs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert runs[True] == runs[False]


def test_tuned_int4_configs_round_trip(tmp_path, monkeypatch):
    """decode_gemv_tune.py --configs-out picks the fastest int4 config per shape (gate_up: among the rows with
    SiLU-mul in its epilogue, as the engine runs it), and DFLASH2_INT4_CONFIGS makes int4_config return it for one
    row; other shapes and more rows keep the tables."""
    import json

    from benchmarks.decode_gemv_tune import engine_configs
    from dflash2.kernels.triton import int4_configs as ic
    from dflash2.kernels.triton import int4_gemv as ig

    common = {"CHUNKS": 128, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1}
    fast, slow = {"BLOCK_N": 8, "PERSISTENT": 4, **common}, {"BLOCK_N": 16, **common}
    rows = [{"shape": "qkv", "kernel": "gemv_int4", "config": slow, "us": 6.0},
            {"shape": "qkv", "kernel": "gemv_int4", "config": fast, "us": 5.0},
            {"shape": "qkv", "kernel": "cublas_bf16", "config": {}, "us": 1.0},
            {"shape": "gate_up", "kernel": "gemv_int4", "config": fast, "us": 19.0},
            {"shape": "gate_up_silu_out", "kernel": "gemv_int4", "config": slow, "us": 21.0},
            {"shape": "gate_up_silu_out", "kernel": "gemv_int4", "config": fast, "us": 22.0},
            {"shape": "down_silu_mul", "kernel": "gemv_int4", "config": fast, "us": 1.0}]
    table = engine_configs(rows)
    assert table == {"6144x4096": fast, "28672x4096": slow}
    path = tmp_path / "int4.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("DFLASH2_INT4_CONFIGS", str(path))
    shape_configs.cache_clear()
    try:
        assert ig.int4_config(6144, 4096, 1, half2=True) == fast
        assert ig.int4_config(28672, 4096, 1) == slow
        assert ig.int4_config(6144, 4096, 4, half2=True) == ic.INT4_HALF2_CONFIGS[4]
        assert ig.int4_config(4096, 14336, 1, half2=True) == ic.INT4_HALF2_CONFIGS[1]
    finally:
        monkeypatch.delenv("DFLASH2_INT4_CONFIGS")
        shape_configs.cache_clear()
    for text in ("not json", '{"6144by4096": {}}', '{"6144x4096": {"BLOCK_N": 8}}'):
        path.write_text(text)
        monkeypatch.setenv("DFLASH2_INT4_CONFIGS", str(path))
        shape_configs.cache_clear()
        try:
            with pytest.raises(ValueError, match="DFLASH2_INT4_CONFIGS=.*not a table of kernel configs"):
                ig.int4_config(6144, 4096, 1)
        finally:
            monkeypatch.delenv("DFLASH2_INT4_CONFIGS")
            shape_configs.cache_clear()


def _smoke_tune(script: str, *args: str) -> list[dict]:
    """A tune script's --smoke run under the interpreter (it must succeed): the JSON rows it printed."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_decode_gemv_tune_smoke(tmp_path):
    """benchmarks/decode_gemv_tune.py --smoke (interpreted): every int4 variant it times (the tables' configs,
    persistent, SiLU-mul on either side) is checked against the shape's default config, and the table it
    writes names one config per shape."""
    import json

    out = tmp_path / "int4.json"
    rows = _smoke_tune("decode_gemv_tune.py", "--int4-only", "--configs-out", str(out))
    int4 = [r for r in rows if r.get("kernel", "").startswith("gemv_int4")]
    assert {r["kernel"] for r in int4} == {"gemv_int4"}
    assert {r["shape"] for r in int4} == {"qkv", "gate_up", "down", "gate_up_silu_out", "down_silu_mul"}
    assert all("error" not in r and r["rel_error"] < 1e-2 for r in int4)
    assert sorted(json.loads(out.read_text())) == ["32x512", "48x256", "64x256"]


def test_prefill_gemm_tune_writes_configs_the_gemm_takes(tmp_path, monkeypatch):
    """benchmarks/prefill_gemm_tune.py --kernel gemm --smoke (interpreted, int8 weights) times its configs, checks
    their results, and writes the best per shape; DFLASH2_GEMM_CONFIGS makes gemm() take it for more than
    GEMM_SMALL_M rows only."""
    import json

    out = tmp_path / "gemm.json"
    rows = _smoke_tune("prefill_gemm_tune.py", "--kernel", "gemm", "--rows", "40", "--configs-out", str(out))
    assert len(rows) == 2 and all(r["kernel"] == "triton_gemm_int8" and r["rel_error"] < 1e-4 for r in rows)
    table = json.loads(out.read_text())
    assert list(table) == ["8:64x256"] and table["8:64x256"] in [r["config"] for r in rows]
    monkeypatch.setenv("DFLASH2_GEMM_CONFIGS", str(out))
    shape_configs.cache_clear()
    try:
        assert qm.gemm_config(8, 64, 256, 40) == table["8:64x256"]
        assert qm.gemm_config(8, 64, 256, qm.GEMM_SMALL_M) == qm.GEMM_SMALL_M_CONFIG
        assert qm.gemm_config(8, 64, 512, 40) == qm.GEMM_CONFIG and qm.gemm_config(4, 64, 256, 40) == qm.GEMM_CONFIG
    finally:
        monkeypatch.delenv("DFLASH2_GEMM_CONFIGS")
        shape_configs.cache_clear()


def test_prefill_gemm_tune_writes_configs_int4_gemm_takes(tmp_path, monkeypatch):
    """The default --kernel int4_gemm: its configs timed and checked, the best written as
    DFLASH2_INT4_GEMM_CONFIGS reads it (BLOCK_M then follows the rows)."""
    import json

    from dflash2.kernels.triton import int4_gemm as ig

    out = tmp_path / "int4_gemm.json"
    rows = _smoke_tune("prefill_gemm_tune.py", "--rows", "40", "--configs-out", str(out))
    assert len(rows) == 2 and all(r["kernel"] == "int4_gemm" and r["rel_error"] < 1e-4 for r in rows)
    table = json.loads(out.read_text())
    assert list(table) == ["64x256"] and table["64x256"] in [r["config"] for r in rows]
    monkeypatch.setenv("DFLASH2_INT4_GEMM_CONFIGS", str(out))
    shape_configs.cache_clear()
    try:
        assert ig.int4_gemm_config(64, 256, 40) == {**table["64x256"], "BLOCK_M": 64}
    finally:
        monkeypatch.delenv("DFLASH2_INT4_GEMM_CONFIGS")
        shape_configs.cache_clear()
