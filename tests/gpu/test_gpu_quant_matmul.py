"""On a CUDA device: the Triton quantized matmul in bf16 on llama-3-8b shapes against dequantize() + matmul in
float32, under CUDA graph capture, and a tiny int4 model's greedy tokens against the "torch" backend."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

# (N, K): qkv, o_proj, gate_up, down (and its transpose)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 4096)]
FORMATS = [(8, None), (4, 128), (6, 128)]


def _packed(bits: int, group_size: int | None, n: int, k: int, seed: int = 0):
    from dflash2.kernels.torch_ref.quant_matmul import PackedWeight
    from dflash2.quantization.formats import WeightFormat
    from dflash2.quantization.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    fmt = WeightFormat(bits, group_size)
    weight = torch.randn(n, k, generator=g, device="cuda") * 0.02
    return PackedWeight(fmt, n, k, quantize(weight, fmt))


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 activations [rows, k], the same on every run (a tolerance checked against fresh random ones is a
    coin toss at its edge)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, k, generator=g, device="cuda").bfloat16()


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bits, group_size", FORMATS)
def test_quantized_kernels_match_reference(n, k, bits, group_size):
    from dflash2.kernels.triton.quant_matmul import TritonQuantMatmul
    from dflash2.quantization.formats import dequantize

    weight = _packed(bits, group_size, n, k, seed=n + k + bits)
    reference = dequantize(weight.fmt, weight.tensors)
    runtime = TritonQuantMatmul().prepare(weight, torch.bfloat16)
    for rows in (1, 3, 16, 200):  # GEMV, GEMV, split-K GEMM, GEMM
        x = _activations(rows, k, seed=rows + n)
        error = _relative_error(runtime.matmul(x), x.float() @ reference.T)
        assert error < 1e-2, (rows, error)


@pytest.mark.parametrize("bits, group_size", [(16, None), *FORMATS])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_silu_mul_input_on_down_proj(bits, group_size, rows):
    from dflash2.kernels.triton.elementwise import silu_and_mul
    from dflash2.kernels.triton.quant_matmul import TritonQuantMatmul
    from dflash2.quantization.formats import dequantize

    weight = _packed(bits, group_size, 4096, 14336)
    runtime = TritonQuantMatmul().prepare(weight, torch.bfloat16)
    gate_up = torch.randn(rows, 2 * 14336, device="cuda").bfloat16()
    expected = silu_and_mul(gate_up).float() @ dequantize(weight.fmt, weight.tensors).T
    assert _relative_error(runtime.matmul(gate_up, silu_mul=True), expected) < 1e-2


@pytest.mark.parametrize("n, k", SHAPES[:2] + [(128256, 4096)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_16bit_matches_cublas(n, k, silu_mul):
    from dflash2.kernels.triton.elementwise import silu_and_mul
    from dflash2.kernels.triton.quant_matmul import gemv_16bit

    weight = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    for rows in (1, 2, 4):
        x = torch.randn(rows, 2 * k if silu_mul else k, device="cuda").bfloat16()
        act = silu_and_mul(x) if silu_mul else x
        assert _relative_error(gemv_16bit(x, weight, silu_mul=silu_mul), act.float() @ weight.float().T) < 1e-2


# qwen3-0.6b's layer shapes (W3's model) and llama-3-8b's o_proj
SKINNY_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096)]


@pytest.mark.parametrize("n, k", SKINNY_SHAPES)
def test_skinny_gemm_matches_float32_matmul(n, k):
    """2-16 rows at the shape's config (or DEFAULT_CONFIG; split along K as skinny_split_k picks it) and at one
    split."""
    from dflash2.kernels.triton.skinny_gemm import DEFAULT_CONFIG, skinny_config, skinny_gemm

    weight = (torch.randn(n, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n + k))
              * 0.02).bfloat16()
    for rows in (2, 5, 11, 16):
        x = _activations(rows, k, seed=rows + k)
        expected = x.float() @ weight.float().T
        assert _relative_error(skinny_gemm(x, weight), expected) < 1e-2
        one_split = {**(skinny_config(n, k) or DEFAULT_CONFIG), "SPLIT_K": 1}
        assert _relative_error(skinny_gemm(x, weight, config=one_split), expected) < 1e-2


def test_skinny_silu_out_is_the_gemm_then_silu_and_mul():
    """Qwen3-0.6B's gate_up with SiLU-mul in the epilogue: the same bits as the plain skinny GEMM's products
    (at the config the epilogue variant reads the same rows with) followed by silu_and_mul."""
    from dflash2.kernels.triton.elementwise import silu_and_mul
    from dflash2.kernels.triton.skinny_gemm import skinny_config, skinny_gemm

    weight = (torch.randn(6144, 1024, device="cuda") * 0.02).bfloat16()
    config = skinny_config(6144, 1024)
    for rows in (2, 11, 16):
        x = _activations(rows, 1024, seed=rows)
        plain = skinny_gemm(x, weight, config={**config, "BLOCK_N": config["BLOCK_N"] // 2, "SPLIT_K": 1})
        assert torch.equal(skinny_gemm(x, weight, silu_out=True), silu_and_mul(plain))


def test_float_mlp_fuses_silu_into_gate_up_at_2_to_16_rows(monkeypatch):
    """LlamaMLP with float weights: silu(gate) * up comes from gate_up's skinny GEMM for 2-16 rows, from down's
    GEMV input at one row and from silu_and_mul above 16; the same values either way (within bf16)."""
    from dflash2.config import ModelArchConfig
    from dflash2.kernels.triton import skinny_gemm
    from dflash2.models.llama import LlamaMLP

    arch = ModelArchConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=1024, intermediate_size=3072,
                           num_layers=1, num_heads=16, num_kv_heads=8, head_dim=128,
                           max_position_embeddings=512)
    mlp = LlamaMLP(arch, 0).cuda().bfloat16()
    for p in mlp.parameters():
        p.data.normal_(0, 0.02)
    fused = []
    original = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda *a, **kw: fused.append(kw.get("silu_out", False)) or original(*a, **kw))
    for rows, silu_out in ((1, False), (2, True), (16, True), (17, False)):
        fused.clear()
        x = _activations(rows, 1024, seed=rows)
        gate_up = x.float() @ mlp.gate_up_proj.weight.float().T
        act = torch.nn.functional.silu(gate_up[:, :3072]) * gate_up[:, 3072:]
        assert _relative_error(mlp(x), act @ mlp.down_proj.weight.float().T) < 2e-2
        assert (True in fused) == silu_out


@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_gemm_graph_replay_matches_eager(split_k):
    from dflash2.kernels.triton.skinny_gemm import skinny_gemm

    weight = (torch.randn(1024, 3072, device="cuda") * 0.02).bfloat16()
    x = torch.randn(11, 3072, device="cuda").bfloat16()
    config = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": split_k}
    _assert_graph_replays_as_eager(lambda out=None: skinny_gemm(x, weight, out=out, config=config))


def test_float_linears_take_the_skinny_gemm_for_2_to_16_rows(monkeypatch):
    """layers.linear.float_matmul's routing on CUDA: the GEMV for one row, the skinny GEMM for 2-16 rows of a
    16-bit weight of a tuned shape, cuBLAS above, for other shapes and for float32 weights; each result against
    float32."""
    from dflash2.kernels.triton import quant_matmul, skinny_gemm
    from dflash2.layers.linear import float_matmul

    calls = []
    originals = {"skinny": skinny_gemm.skinny_gemm, "gemv": quant_matmul.gemv_16bit}

    def counted(name):
        return lambda *args, **kwargs: calls.append(name) or originals[name](*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_gemm", counted("skinny"))
    monkeypatch.setattr(quant_matmul, "gemv_16bit", counted("gemv"))
    weight = (torch.randn(4096, 1024, device="cuda") * 0.05).bfloat16()  # a shape with a skinny config
    for rows, path in ((1, "gemv"), (2, "skinny"), (4, "skinny"), (16, "skinny"), (17, None)):
        calls.clear()
        x = torch.randn(rows, 1024, device="cuda").bfloat16()
        assert _relative_error(float_matmul(x, weight), x.float() @ weight.float().T) < 1e-2
        assert calls == ([path] if path else [])
    calls.clear()
    untuned = (torch.randn(512, 256, device="cuda") * 0.05).bfloat16()
    for x, w in ((torch.randn(8, 256, device="cuda").bfloat16(), untuned),  # no config: cuBLAS
                 (torch.randn(8, 256, device="cuda"), untuned.float())):  # float32: cuBLAS
        assert _relative_error(float_matmul(x, w), x.float() @ w.float().T) < 1e-2
    x = torch.randn(8, 2048, device="cuda").bfloat16()  # SiLU-mul input: silu_and_mul + cuBLAS
    float_matmul(x, weight, silu_mul=True)
    assert calls == []


def _assert_graph_replays_as_eager(call) -> None:
    """`call(out=None)` (a GEMV) captured three times in a CUDA graph gives its eager result on every replay,
    and the split-K tickets are all back to zero afterwards."""
    from dflash2.kernels.triton.gemv_parts import split_counters

    eager = call()
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call(out=out)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            call(out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not split_counters(eager.device, 1).any()


@pytest.mark.parametrize("split_k", [1, 4])
def test_graph_replay_matches_eager(split_k):
    """Captured calls of the GEMV (int8; split-K tickets included) give the eager result on every replay."""
    from dflash2.kernels.triton import quant_matmul as qm

    weight = _packed(8, None, 4096, 4096)
    tensors = qm.device_tensors(weight, torch.bfloat16)
    config = {**qm.gemv_config(8, 4096, 4096), "SPLIT_K": split_k}
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    _assert_graph_replays_as_eager(lambda out=None: qm.gemv(x, tensors, out=out, config=config))


LLAMA3_8B_INT4 = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # qkv .. lm_head


def _int4_prepared(n: int, k: int, seed: int = 0):
    from dflash2.kernels.triton.int4_gemv import prepare_int4
    from dflash2.quantization.formats import dequantize

    weight = _packed(4, 128, n, k, seed=seed)
    tensors = weight.tensors
    return dequantize(weight.fmt, tensors), prepare_int4(tensors["qweight"], tensors["scales"], tensors["zeros"], 128)


@pytest.mark.parametrize("n, k", LLAMA3_8B_INT4)
def test_int4_gemv_on_llama3_8b_shapes(n, k):
    """The int4 decode kernel (kernels/triton/int4_gemv.py) at its default configs, M = 1..4, bf16."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    reference, prepared = _int4_prepared(n, k, seed=n + k)
    for rows in (1, 2, 3, 4):
        x = _activations(rows, k, seed=rows + n)
        error = _relative_error(int4_gemv(x, prepared), x.float() @ reference.T)
        assert error < 5e-3, (rows, error)


@pytest.mark.parametrize("n, k", LLAMA3_8B_INT4)
def test_int4_half2_gemv_on_llama3_8b_shapes(n, k):
    """The packed fp16 products (half2, inline PTX) at the default configs, M = 1..4, bf16 in and out, and the
    paired gate/up with silu_out on gate_up's shape."""
    from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up, prepare_int4
    from dflash2.quantization.formats import dequantize

    weight = _packed(4, 128, n, k, seed=n + k)
    t = weight.tensors
    reference = dequantize(weight.fmt, t)
    prepared = prepare_int4(t["qweight"], t["scales"], t["zeros"], 128, half2=True)
    limit = 5e-3
    for rows in (1, 2, 3, 4):
        x = _activations(rows, k, seed=rows + n)
        want = x.float() @ reference.T
        error = _relative_error(int4_gemv(x, prepared), want)
        assert error < limit, (rows, error)
        if n == 28672:
            half = n // 2
            silu = torch.nn.functional.silu(want[:, :half]) * want[:, half:]
            error = _relative_error(int4_gemv(x, pair_gate_up(prepared), silu_out=True), silu)
            assert error < 1e-2, (rows, error)
    # activations far from 1: the fp16 products are of q / 256, so sums of 16 stay in fp16's range at 1e4
    for scale in (1e4, 1e-2, 1e-3):
        x = (_activations(1, k, seed=n).float() * scale).bfloat16()
        got = int4_gemv(x, prepared)
        assert torch.isfinite(got).all(), scale
        assert _relative_error(got, x.float() @ reference.T) < limit, scale


@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 14336)])
def test_int4_gemv_every_tuning_candidate(n, k):
    """Every config benchmarks/decode_gemv_tune.py tries computes the right thing (a fast wrong one must not win)."""
    from benchmarks.decode_gemv_tune import INT4_CONFIGS
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    reference, prepared = _int4_prepared(n, k)
    for rows in (1, 4):
        x = _activations(rows, k, seed=rows + n)
        expected = x.float() @ reference.T
        for config in INT4_CONFIGS:
            assert _relative_error(int4_gemv(x, prepared, config=config), expected) < 5e-3, (rows, config)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_int4_gemv_silu_mul_on_down_proj(rows):
    from dflash2.kernels.triton.elementwise import silu_and_mul
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    reference, prepared = _int4_prepared(4096, 14336)
    gate_up = torch.randn(rows, 2 * 14336, device="cuda").bfloat16()
    expected = silu_and_mul(gate_up).float() @ reference.T
    assert _relative_error(int4_gemv(gate_up, prepared, silu_mul=True), expected) < 5e-3


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_int4_gemv_gate_up_silu_out_is_exact(rows):
    """llama-3-8b's gate_up with its rows paired (pair_gate_up): silu_out equals the unpaired GEMV followed by the
    silu_and_mul kernel bit for bit in bf16, and a plain product keeps [gate | up] order, at the default configs."""
    from dflash2.kernels.triton.elementwise import silu_and_mul
    from dflash2.kernels.triton.int4_gemv import int4_gemv, pair_gate_up

    _, prepared = _int4_prepared(28672, 4096)
    paired = pair_gate_up(prepared)
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    plain = int4_gemv(x, prepared)
    assert torch.equal(int4_gemv(x, paired), plain)
    assert torch.equal(int4_gemv(x, paired, silu_out=True), silu_and_mul(plain))


@pytest.mark.parametrize("split_k", [1, 4])
def test_int4_gemv_graph_replay_matches_eager(split_k):
    from dflash2.kernels.triton.int4_gemv import int4_config, int4_gemv

    _, prepared = _int4_prepared(4096, 4096)
    config = {**int4_config(4096, 4096), "SPLIT_K": split_k}
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    _assert_graph_replays_as_eager(lambda out=None: int4_gemv(x, prepared, out=out, config=config))


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    from dflash2.cli.main import main as dflash2_main
    from tests.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-int4")
    source, out = str(root / "source"), str(root / "int4")
    build_tiny_model("llama", source)
    assert dflash2_main(["convert", "--model-path", source, "--output-path", out, "--dtype", "int4",
                         "--no-progress"]) == 0
    return out


def test_int4_engine_matches_torch_backend(tiny_int4, monkeypatch):
    import dflash2.engine.model_setup as model_setup_module
    from dflash2 import LLM, SamplingParams
    from dflash2.loading.model_loader import load_model

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    common = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128, kv_cache_memory="64MiB",
                  page_bytes=4096)
    runs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setattr(model_setup_module, "load_model",
                            lambda *args, backend=backend, **kw: load_model(*args, quant_backend=backend, **kw))
        llm = LLM(tiny_int4, **common)
        layer = llm.engine.model.module.layers[0].mlp.down_proj
        assert ("Triton" in layer.runtime.kernel) == (backend == "triton"), layer.runtime.kernel
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("n, k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_int4_gemv_norm_and_residual_add(n, k):
    """The RMSNorm prologue (norm=) and residual-add epilogue (add_out) of the int4 GEMV in bf16, at the default
    config and the persistent ones, against rms_norm + GEMV and GEMV + add: the add bit for bit, the norm within
    rounding (its statistics are summed in another order)."""
    from benchmarks.decode_gemv_tune import PERSISTENT_CONFIGS
    from dflash2.kernels.triton.elementwise import rms_norm
    from dflash2.kernels.triton.int4_gemv import int4_gemv

    _, prepared = _int4_prepared(n, k, seed=n)
    norm_weight = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    for config in [None] + PERSISTENT_CONFIGS[:4]:
        for rows in (1, 2, 4):  # the defaults differ by rows (int4_configs.INT4_HALF2_CONFIGS)
            residual = (torch.randn(rows, k, device="cuda") * 4).bfloat16()
            plain = int4_gemv(rms_norm(residual, norm_weight, 1e-5), prepared, config=config)
            fused = int4_gemv(residual, prepared, config=config, norm=(norm_weight, 1e-5))
            assert _relative_error(fused, plain.float()) < 2e-3, (config, rows)
            for settled in (False, True):  # out_settled: read before the PDL wait (the regular kernel)
                stream = torch.randn(rows, n, device="cuda").bfloat16()
                want = stream + int4_gemv(residual, prepared, config=config)
                added = int4_gemv(residual, prepared, out=stream, config=config, add_out=True, out_settled=settled)
                assert torch.equal(added, want), (config, rows, settled)


def test_int4_engine_folds_norms(tiny_int4, monkeypatch):
    """The tiny int4 model's greedy tokens with each layer's norms and residual adds folded into its GEMVs
    (decode steps, CUDA graphs) equal the "torch" backend's."""
    import dflash2.engine.model_setup as model_setup_module
    from dflash2 import LLM, SamplingParams
    from dflash2.loading.model_loader import load_model

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    runs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setattr(model_setup_module, "load_model",
                            lambda *args, backend=backend, **kw: load_model(*args, quant_backend=backend, **kw))
        llm = LLM(tiny_int4, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
                  kv_cache_memory="64MiB", page_bytes=4096)
        assert llm.engine.model.module.layers[0].fuses_norms(1) == (backend == "triton")
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                  params)]
        assert backend == "torch" or sum(llm.engine.runner.graphs.replays.values()) > 0
        del llm
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("n, k", LLAMA3_8B_INT4[:4])
def test_int4_gemm_on_llama3_8b_shapes(n, k):
    """The int4 prefill GEMM (kernels/triton/int4_gemm.py) at its default configs and at every config the tune
    tries (a fast wrong one must not win), bf16, against dequantize() + a float32 matmul; rows that fill no
    whole block (77) and a split along K."""
    from benchmarks.prefill_gemm_tune import int4_gemm_configs
    from dflash2.kernels.triton import quant_matmul as qm
    from dflash2.kernels.triton.int4_gemm import int4_gemm

    weight = _packed(4, 128, n, k, seed=n + k)
    reference = _dequantized(weight)
    tensors = qm.device_tensors(weight, torch.bfloat16)
    for rows in (5, 77, 128, 300):
        x = _activations(rows, k, seed=rows + n)
        expected = x.float() @ reference.T
        assert _relative_error(qm.gemm(x, tensors), expected) < 5e-3, rows
    x = _activations(128, k, seed=n)
    expected = x.float() @ reference.T
    for config in int4_gemm_configs(n, k) + [{**int4_gemm_configs(n, k)[0], "SPLIT_K": 3}]:
        assert _relative_error(int4_gemm(x, tensors, config=config), expected) < 5e-3, config


def _dequantized(weight) -> torch.Tensor:
    from dflash2.quantization.formats import dequantize

    return dequantize(weight.fmt, weight.tensors).float()


@pytest.mark.parametrize("group_size, k", [(32, 576), (64, 1536), (128, 4096)])
def test_int4_gemm_group_sizes_and_ragged_k(group_size, k):
    """Group sizes below 128, and K that is not a whole number of tiles (the bundled model's 576 at 64)."""
    from dflash2.kernels.triton import quant_matmul as qm

    weight = _packed(4, group_size, 1000, k, seed=k)
    tensors = qm.device_tensors(weight, torch.bfloat16)
    x = _activations(40, k, seed=k)
    assert _relative_error(qm.gemm(x, tensors), x.float() @ _dequantized(weight).T) < 5e-3


@pytest.mark.parametrize("split_k", [1, 4])
def test_int4_gemm_graph_replay_matches_eager(split_k):
    from dflash2.kernels.triton import quant_matmul as qm
    from dflash2.kernels.triton.int4_gemm import DEFAULT_CONFIG, int4_gemm

    tensors = qm.device_tensors(_packed(4, 128, 4096, 14336), torch.bfloat16)
    x = _activations(128, 14336, seed=split_k)
    config = {**DEFAULT_CONFIG, "SPLIT_K": split_k}
    _assert_graph_replays_as_eager(lambda out=None: int4_gemm(x, tensors, out=out, config=config))
