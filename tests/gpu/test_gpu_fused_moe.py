"""On a CUDA device: the fused MoE kernels (kernels/triton/fused_moe.py) on qwen3-30b-a3b's and mixtral-8x7b's expert
shapes in bf16 against models/moe.experts_by_group on the float32 (dequantized) weights, the Experts module's CUDA
path, a CUDA graph's replays against eager calls; the one-launch router (moe_router.py) against torch's route."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

QWEN3 = (128, 8, 2048, 768)  # E, k, H, I
MIXTRAL = (8, 2, 4096, 14336)


def _experts(bits: int, group_size: int | None, num_experts: int, n: int, k: int, seed: int
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random [E, n, k] weights in a format: (the stacked tensors, dequantized in float32)."""
    from dflash2.quantization.formats import WeightFormat, dequantize
    from dflash2.quantization.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    fmt = WeightFormat(bits, group_size)
    parts = [quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, fmt) for _ in range(num_experts)]
    stacked = {name: torch.stack([p[name] for p in parts]) for name in parts[0]}
    return stacked, torch.stack([dequantize(fmt, p) for p in parts])


def _moe_args(bits: int, group_size: int | None, num_experts: int, hidden: int, inter: int
              ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    gate_up, gate_up_float = _experts(bits, group_size, num_experts, 2 * inter, hidden, seed=1)
    down, down_float = _experts(bits, group_size, num_experts, hidden, inter, seed=2)
    if bits == 16:
        return {"w_gate_up": gate_up["weight"], "w_down": down["weight"]}, gate_up_float, down_float
    args = {"w_gate_up": gate_up["qweight"], "w_down": down["qweight"], "bits": bits, "group_size": group_size,
            "gate_up_scales": gate_up["scales"], "down_scales": down["scales"]}
    if "zeros" in gate_up:
        args.update(gate_up_zeros=gate_up["zeros"], down_zeros=down["zeros"])
    return args, gate_up_float, down_float


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g, device="cuda")
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("bits, group_size", [(16, None), (8, None), (4, 128), (6, 128)])
def test_qwen3_shapes_match_reference(bits, group_size):
    from dflash2.kernels.triton.fused_moe import fused_moe
    from dflash2.models.moe import experts_by_group

    num_experts, top_k, hidden, inter = QWEN3
    args, gate_up, down = _moe_args(bits, group_size, num_experts, hidden, inter)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    for num_tokens in (1, 7, 64, 300, 2048):  # decode to prefill: BLOCK_M 16, 32 and 64 by default
        x = torch.randn(num_tokens, hidden, generator=torch.Generator(device="cuda").manual_seed(num_tokens),
                        device="cuda").bfloat16()
        weights, ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
        expected = experts_by_group(x.float(), gate_up, down, weights, ids)
        got = fused_moe(x, w_gate_up, w_down, weights.bfloat16(), ids.int(), **args)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        error = _relative_error(got, expected)
        assert error < 1e-2, (num_tokens, error)


@pytest.mark.parametrize("bits, group_size", [(16, None), (8, None), (4, 128), (6, 128)])
def test_qwen3_small_path_matches_reference(bits, group_size):
    """The decode path (fused_moe_small.py) at its default and at split / narrow configs, against the reference and
    against the blocks' path (the same rounding: the two differ by float32 summation order only)."""
    from dflash2.kernels.triton.fused_moe import fused_moe
    from dflash2.models.moe import experts_by_group

    num_experts, top_k, hidden, inter = QWEN3
    args, gate_up, down = _moe_args(bits, group_size, num_experts, hidden, inter)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    configs = [None, {"SMALL": 1, "SPLIT_K": 4, "down": {"SPLIT_K": 2}},
               {"SMALL": 1, "BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 8}]
    for num_tokens in (1, 3, 4):
        x = torch.randn(num_tokens, hidden, generator=torch.Generator(device="cuda").manual_seed(num_tokens),
                        device="cuda").bfloat16()
        weights, ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
        ids[~(ids == 7).any(dim=1), -1] = 7  # every token on expert 7 (distinct experts a token still)
        expected = experts_by_group(x.float(), gate_up, down, weights, ids)
        blocks = fused_moe(x, w_gate_up, w_down, weights, ids, config={"SMALL": 0}, **args)
        for config in configs:
            got = fused_moe(x, w_gate_up, w_down, weights, ids.int(), config=config, **args)
            assert _relative_error(got, expected) < 1e-2, (num_tokens, config)
            assert _relative_error(got, blocks.float()) < 5e-3, (num_tokens, config)


def test_mixtral_shape_matches_reference():
    from dflash2.kernels.triton.fused_moe import fused_moe
    from dflash2.models.moe import experts_by_group

    num_experts, top_k, hidden, inter = MIXTRAL
    args, gate_up, down = _moe_args(16, None, num_experts, hidden, inter)
    for num_tokens in (1, 33, 512):
        x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
        weights, ids = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
        expected = experts_by_group(x.float(), gate_up, down, weights, ids)
        error = _relative_error(fused_moe(x, args["w_gate_up"], args["w_down"], weights, ids), expected)
        assert error < 1e-2, (num_tokens, error)


def test_experts_module_runs_the_kernel():
    """Experts.forward on CUDA (fused_moe) against its CPU path (experts_by_group) on the same bf16 weights."""
    from dflash2.models.moe import Experts, experts_by_group

    num_experts, top_k, hidden, inter = 16, 4, 512, 256
    experts = Experts(num_experts, hidden, inter).cuda().bfloat16()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(37, hidden, device="cuda").bfloat16()
    weights, ids = _routing(37, num_experts, top_k, seed=3)
    weights = weights.bfloat16()
    expected = experts_by_group(x.float(), experts.gate_up_proj.float(), experts.down_proj.float(), weights.float(),
                                ids)
    assert _relative_error(experts(x, weights, ids), expected) < 1e-2


@pytest.mark.parametrize("bits, group_size, num_tokens, config", [
    (16, None, 24, None), (4, 128, 24, None),
    (16, None, 2, {"SMALL": 1, "SPLIT_K": 2}),  # the small path's split tickets across replays
    (4, 128, 1, None),
])
def test_cuda_graph_replay_matches_eager(bits, group_size, num_tokens, config):
    """Captured once, replayed after the router's outputs and x change in place: the same as eager calls on the new
    inputs (the layout, the grid and the allocations do not depend on the routing)."""
    from dflash2.kernels.triton.fused_moe import fused_moe

    num_experts, top_k, hidden, inter = QWEN3
    args, _, _ = _moe_args(bits, group_size, num_experts, hidden, inter)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, num_experts, top_k, seed=0)

    def call() -> torch.Tensor:
        return fused_moe(x, w_gate_up, w_down, weights, ids, config=config, **args)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in range(1, 4):
        new_weights, new_ids = _routing(num_tokens, num_experts, top_k, seed=seed)
        if seed == 3:  # every token on experts 0 .. k-1 (24 tokens: two full blocks each), the others empty
            new_ids = torch.arange(top_k, device="cuda").expand(num_tokens, top_k).contiguous()
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, call(), atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 10, 40])  # 40: past FUSED_MAX_TOKENS (F.linear's logits)
@pytest.mark.parametrize("num_experts, top_k", [(128, 8), (60, 4)])
def test_router_kernel_picks_the_torch_routes_experts(num_tokens, num_experts, top_k):
    """kernels/triton/moe_router.py in float32 (no 16-bit rounding of the logits to differ on): the same experts in
    the same order as SparseMoeBlock.route's torch ops, the weights equal to float32 rounding."""
    from dflash2.kernels.triton.moe_router import moe_route
    from dflash2.models.moe import torch_route

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2048, generator=g, device="cuda")
    gate = torch.randn(num_experts, 2048, generator=g, device="cuda") * 0.05
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # F.linear's logits (the reference's, and past 16 tokens the
    try:                                           # kernel's) in full float32
        weights, ids = moe_route(x, gate, top_k, True, torch.float32)
        ref_weights, ref_ids = torch_route(x, gate, top_k, True, torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_router_kernel_in_a_cuda_graph_matches_eager():
    """Captured once at 4 tokens (the ticket path, bf16), replayed on new x: each replay equals an eager call."""
    from dflash2.kernels.triton.moe_router import moe_route

    x = torch.randn(4, 2048, device="cuda").bfloat16()
    gate = (torch.randn(128, 2048, device="cuda") * 0.05).bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_route(x, gate, 8, True, torch.bfloat16)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = moe_route(x, gate, 8, True, torch.bfloat16)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager_weights, eager_ids = moe_route(x, gate, 8, True, torch.bfloat16)
        assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_weights)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_float_engine_folds_norms_at_one_row(arch, tmp_path, monkeypatch):
    """A float model's decode steps of one row fold each layer's RMSNorms into the kernels that read them (the
    16-bit GEMV for qkv / gate_up, the router for a sparse layer, which hands the normed row to the experts) and
    its residual adds into the ones that produce them (o_proj, down, the experts' down kernel): the greedy tokens
    equal those with the separate norms (fuses_norms patched off), in float32 (the same arithmetic either way;
    bf16 would let a sum's order flip a rounding). qwen3_moe's layer 0 is dense, the others sparse."""
    from dflash2 import LLM, SamplingParams
    from dflash2.models.llama import LlamaDecoderLayer
    from dflash2.models.moe import SparseMoeBlock
    from tests.tiny_models import build_tiny_model

    build_tiny_model(arch, str(tmp_path))
    prompts = [[5, 17, 99, 3, 250, 8, 41], [40, 41, 42]]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    fuses_norms = LlamaDecoderLayer.fuses_norms
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LlamaDecoderLayer, "fuses_norms", lambda self, rows: False)
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=1, max_model_len=128,
                  kv_cache_memory="64MiB", page_bytes=4096)
        layers = llm.engine.model.module.layers
        assert all(fuses_norms(layer, 1) and not fuses_norms(layer, 2) for layer in layers)
        assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in layers) == (arch == "qwen3_moe")
        runs[fused] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                params)]
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
        del llm
    assert runs[True] == runs[False]


def test_bf16_fold_kernels_match_the_separate_steps():
    """On bf16 rows of qwen3-30b-a3b's shapes: the 16-bit GEMV with norm= against rms_norm then the GEMV, with
    add_out against the GEMV then the add; the router with the norm folded against rms_norm then the router (the
    same experts, the normed rows equal); the experts' down kernel adding into the stream against the add."""
    from dflash2.kernels.triton.elementwise import rms_norm
    from dflash2.kernels.triton.fused_moe import fused_moe
    from dflash2.kernels.triton.moe_router import moe_route, moe_route_normed
    from dflash2.kernels.triton.quant_matmul import gemv_16bit

    g = torch.Generator(device="cuda").manual_seed(0)
    num_experts, top_k, hidden, inter = QWEN3
    residual = torch.randn(1, hidden, device="cuda", generator=g).bfloat16() * 4
    norm_weight = (torch.rand(hidden, device="cuda", generator=g) + 0.5).bfloat16()
    weight = (torch.randn(5120, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    normed = rms_norm(residual, norm_weight, 1e-6)
    got = gemv_16bit(residual, weight, norm=(norm_weight, 1e-6))
    assert _relative_error(got, gemv_16bit(normed, weight).float()) < 2e-3
    stream = torch.randn(1, 5120, device="cuda", generator=g).bfloat16()
    want = stream + gemv_16bit(normed, weight)
    assert torch.equal(gemv_16bit(normed, weight, out=stream, add_out=True), want)
    gate = (torch.randn(num_experts, hidden, device="cuda", generator=g) * 0.3).bfloat16()
    weights, ids, routed_rows = moe_route_normed(residual, gate, top_k, True, torch.bfloat16, (norm_weight, 1e-6))
    ref_weights, ref_ids = moe_route(normed, gate, top_k, True, torch.bfloat16)
    assert torch.equal(ids, ref_ids)  # the normed rows may differ in an ulp (another sum order), the picks not
    assert _relative_error(weights, ref_weights.float()) < 1e-2
    assert _relative_error(routed_rows, normed.float()) < 2e-3
    args, _, _ = _moe_args(16, None, num_experts, hidden, inter)
    w_gate_up, w_down = args["w_gate_up"].bfloat16(), args["w_down"].bfloat16()
    stream = torch.randn(1, hidden, device="cuda", generator=g).bfloat16()
    want = stream + fused_moe(normed, w_gate_up, w_down, ref_weights, ref_ids)
    assert torch.equal(fused_moe(normed, w_gate_up, w_down, ref_weights, ref_ids, add_to=stream), want)
