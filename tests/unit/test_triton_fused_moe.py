"""The fused MoE kernels (kernels/triton/fused_moe.py, moe_align.py) under TRITON_INTERPRET=1 on the CPU, against
models/moe.experts_by_group on the same weights (quantized ones dequantized by quantization/formats.dequantize).

The interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to nearest), so the bf16 cases compare
with the float32 result of the same bf16 weights by the norm of the error, at a bound that truncation meets."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.kernels.triton import fused_moe_configs as fmc  # noqa: E402
from dflash2.kernels.triton.fused_moe import fused_moe  # noqa: E402
from dflash2.kernels.triton.moe_align import align_by_expert, max_rows  # noqa: E402
from dflash2.models.moe import experts_by_group  # noqa: E402
from dflash2.quantization.formats import WeightFormat, dequantize  # noqa: E402
from dflash2.quantization.quantize import quantize  # noqa: E402

# one program a block of rows for each GEMM at these widths (the interpreter's time goes by programs); the blocks'
# path even where the small one is the default
WIDE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 1, "SMALL": 0}
# the small path (fused_moe_small.py): one program a pair for each GEMM at hidden 64, intermediate 32; SPLIT two K
# steps of the gate_up GEMM and of the down GEMM in two programs each (3 asked, 2 steps), the down's 64 columns in
# two tiles
SMALL = {"SMALL": 1, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4}
SPLIT = {**SMALL, "BLOCK_K": 32, "SPLIT_K": 2, "down": {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 3}}
NAMES = {"gate_up": ("gate_up_scales", "gate_up_zeros"), "down": ("down_scales", "down_zeros")}


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int, skip: int | None = None,
            favourite: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, renormalized softmax weights in float32; `skip` never chosen, `favourite`
    chosen by every token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip is not None:
        logits[:, skip] = -float("inf")
    if favourite is not None:
        logits[:, favourite] += 20.0
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


def experts(bits: int, group_size: int | None, num_experts: int, n: int, k: int, seed: int
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random weights [E, n, k] in a format: (its stacked tensors, the dequantized weights in float32)."""
    g = torch.Generator().manual_seed(seed)
    fmt = WeightFormat(bits, group_size)
    per_expert = [quantize(torch.randn(n, k, generator=g) * 0.15, fmt) for _ in range(num_experts)]
    stacked = {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}
    return stacked, torch.stack([dequantize(fmt, t) for t in per_expert])


def moe_inputs(bits: int, group_size: int | None, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """fused_moe's weight arguments, and the float32 gate_up and down weights they stand for."""
    gate_up, gate_up_float = experts(bits, group_size, num_experts, 2 * inter, hidden, seed)
    down, down_float = experts(bits, group_size, num_experts, hidden, inter, seed + 1)
    if bits == 16:
        return ({"w_gate_up": gate_up["weight"].to(dtype), "w_down": down["weight"].to(dtype)},
                gate_up["weight"].to(dtype).float(), down["weight"].to(dtype).float())
    args = {"w_gate_up": gate_up["qweight"], "w_down": down["qweight"], "bits": bits, "group_size": group_size}
    for name, tensors in (("gate_up", gate_up), ("down", down)):
        args[NAMES[name][0]] = tensors["scales"]
        if "zeros" in tensors:
            args[NAMES[name][1]] = tensors["zeros"]
    return args, gate_up_float, down_float


def check(num_tokens: int, num_experts: int, top_k: int, bits: int = 16, group_size: int | None = None,
          dtype: torch.dtype = torch.float32, hidden: int = 64, inter: int = 32, config: dict | None = WIDE,
          weights_dtype: torch.dtype = torch.float32, ids_dtype: torch.dtype = torch.int64, **routing_kw) -> None:
    args, gate_up, down = moe_inputs(bits, group_size, num_experts, hidden, inter, dtype, seed=num_tokens + bits)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    weights, ids = routing(num_tokens, num_experts, top_k, seed=num_tokens * top_k + num_experts, **routing_kw)
    weights, ids = weights.to(weights_dtype), ids.to(ids_dtype)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    got = fused_moe(x, w_gate_up, w_down, weights, ids, config=config, **args)
    assert got.shape == x.shape and got.dtype == dtype
    expected = experts_by_group(x.float(), gate_up, down, weights.float(), ids.long())
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=3e-5, rtol=1e-5)
    else:  # bfloat16: the interpreter's truncations (six roundings on the way, each 0.4% low on average)
        error = float((got.float() - expected).norm() / expected.norm())
        assert error < (4e-2 if dtype == torch.bfloat16 else 5e-3), error


@pytest.mark.parametrize("num_tokens, num_experts, top_k, routing_kw", [
    (1, 4, 1, {}),
    (3, 8, 2, {}),
    (17, 8, 2, {"skip": 3}),  # an expert in the middle with no tokens
    (64, 4, 2, {"favourite": 1}),  # every token on expert 1: four blocks of it
])
def test_16_bit_matches_reference(num_tokens, num_experts, top_k, routing_kw):
    check(num_tokens, num_experts, top_k, **routing_kw)


@pytest.mark.parametrize("bits, group_size, num_tokens, num_experts, top_k", [
    (8, None, 3, 8, 2), (4, 32, 3, 8, 2), (6, 32, 3, 8, 2), (4, 32, 17, 4, 1)])
def test_quantized_matches_dequantized_reference(bits, group_size, num_tokens, num_experts, top_k):
    check(num_tokens, num_experts, top_k, bits, group_size)


@pytest.mark.parametrize("bits, group_size, dtype, weights_dtype, ids_dtype", [
    (16, None, torch.bfloat16, torch.float32, torch.int64),
    (8, None, torch.float16, torch.float16, torch.int32),  # router weights in x's dtype, int32 ids
    (4, 32, torch.bfloat16, torch.bfloat16, torch.int64),
    (6, 32, torch.float16, torch.float32, torch.int32),
])
def test_half_precision(bits, group_size, dtype, weights_dtype, ids_dtype):
    check(9, 4, 2, bits, group_size, dtype=dtype, weights_dtype=weights_dtype, ids_dtype=ids_dtype, skip=0)


@pytest.mark.parametrize("bits, group_size, hidden, inter, config", [
    # K tails: H = 80 is 1.25 steps of 64 (gate_up), I = 48 0.75 of one (down); column blocks of 32, the last
    # ones part past the end
    (16, None, 80, 48, {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 4,
                        "num_stages": 2}),
    # int4 at I = 96, group 32: steps of 64 take two groups, the last step's second one past K
    (4, 32, 64, 96, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}),
    # steps of 32 inside groups of 64 (one scale a step), int6
    (6, 64, 64, 64, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}),
    (4, 64, 128, 64, WIDE),  # two groups of 64 a row of gate_up
    (8, None, 64, 32, None),  # the default config for the shape
])
def test_ragged_shapes_and_configs(bits, group_size, hidden, inter, config):
    check(6, 4, 2, bits, group_size, hidden=hidden, inter=inter, config=config)


@pytest.mark.parametrize("num_tokens, top_k, bits, group_size, config, routing_kw", [
    (1, 8, 16, None, SMALL, {}),
    (3, 8, 16, None, SMALL, {"favourite": 5}),  # every token on expert 5: pairs of three tokens share it
    (3, 8, 16, None, SPLIT, {"favourite": 5}),
    (3, 4, 8, None, SPLIT, {}),
    (3, 8, 4, 32, SMALL, {"favourite": 5}),  # K steps of two groups
    (1, 8, 4, 32, SPLIT, {}),
    (3, 4, 6, 32, SPLIT, {"favourite": 5}),
    (1, 8, 6, 32, None, {}),  # the default config: T k = 8 <= E = 16 takes the small path
])
def test_small_path_matches_reference(num_tokens, top_k, bits, group_size, config, routing_kw):
    check(num_tokens, 16, top_k, bits, group_size, config=config, **routing_kw)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, inter, config", [
    (2, 4, 1, 64, 32, SMALL),  # one slot, one K share: no tickets, the rows stored directly
    (2, 4, 1, 64, 32, SPLIT),
    # K tails (H = 80 is 2.5 steps of 32; I = 48 three of 16, cut into 2 shares) and column tiles past the end
    (3, 8, 2, 80, 48, {**SPLIT, "BLOCK_N": 32, "down": {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2}}),
    (3, 8, 2, 64, 32, {**SMALL, "BLOCK_N": 4, "down": {"BLOCK_N": 8}}),  # tiles narrower than tl.dot takes
])
def test_small_path_shapes_and_configs(num_tokens, num_experts, top_k, hidden, inter, config):
    check(num_tokens, num_experts, top_k, hidden=hidden, inter=inter, config=config)


@pytest.mark.parametrize("bits, group_size, dtype, weights_dtype, ids_dtype", [
    (16, None, torch.bfloat16, torch.float32, torch.int64),
    (8, None, torch.float16, torch.float16, torch.int32),
    (4, 32, torch.bfloat16, torch.bfloat16, torch.int32),
])
def test_small_path_half_precision(bits, group_size, dtype, weights_dtype, ids_dtype):
    check(2, 16, 4, bits, group_size, dtype=dtype, config=SPLIT, weights_dtype=weights_dtype, ids_dtype=ids_dtype,
          favourite=2)


def test_small_path_skips_the_alignment_and_leaves_its_counters_zero(monkeypatch):
    """The default at T k = 8 of 16 experts: no moe_align launch; split tickets reset, so a second call (and the
    blocks' path) agree."""
    from dflash2.kernels.triton import fused_moe as module
    from dflash2.kernels.triton.gemv_parts import split_counters

    args, _, _ = moe_inputs(4, 32, 16, 64, 32, torch.float32)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    x = torch.randn(1, 64)
    weights, ids = routing(1, 16, 8, seed=2)
    blocks = fused_moe(x, w_gate_up, w_down, weights, ids, config=WIDE, **args)
    monkeypatch.setattr(module, "align_by_expert", None)
    first = fused_moe(x, w_gate_up, w_down, weights, ids, config={"SPLIT_K": 2}, **args)
    assert int(split_counters(x.device, 1).abs().sum()) == 0
    assert torch.equal(fused_moe(x, w_gate_up, w_down, weights, ids, config={"SPLIT_K": 2}, **args), first)
    torch.testing.assert_close(first, blocks, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens, top_k, config", [(1, 4, SPLIT), (2, 1, SMALL), (3, 2, None)])
def test_small_path_adds_into_the_residual_stream(num_tokens, top_k, config):
    """add_to: the down kernel adds the sum into that tensor as it stores (the residual add), with tickets
    (k slots, K shares) and without (one slot, one share); the blocks' path refuses it."""
    args, _, _ = moe_inputs(16, None, 16, 64, 32, torch.float32)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    weights, ids = routing(num_tokens, 16, top_k, seed=5)
    stream = torch.randn(num_tokens, 64)
    want = stream + fused_moe(x, w_gate_up, w_down, weights, ids, config=config)
    got = fused_moe(x, w_gate_up, w_down, weights, ids, config=config, add_to=stream)
    assert got.data_ptr() == stream.data_ptr()
    torch.testing.assert_close(stream, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="add_to"):
        fused_moe(x, w_gate_up, w_down, weights, ids, config=WIDE, add_to=stream)
    with pytest.raises(ValueError, match="add_to"):
        fused_moe(x, w_gate_up, w_down, weights, ids, config=config, add_to=stream[:, :32])


def test_repeated_calls_agree():
    """Nothing depends on uninitialized memory (the layout's, the intermediate's)."""
    args, _, _ = moe_inputs(4, 32, 4, 64, 32, torch.float32)
    x = torch.randn(9, 64)
    weights, ids = routing(9, 4, 2, seed=1)
    first = fused_moe(x, args.pop("w_gate_up"), args.pop("w_down"), weights, ids, config=WIDE, **args)
    args, _, _ = moe_inputs(4, 32, 4, 64, 32, torch.float32)
    assert torch.equal(fused_moe(x, args.pop("w_gate_up"), args.pop("w_down"), weights, ids, config=WIDE, **args),
                       first)


def test_no_tokens():
    args, _, _ = moe_inputs(16, None, 4, 64, 32, torch.float32)
    out = fused_moe(torch.empty(0, 64), args["w_gate_up"], args["w_down"], torch.empty(0, 2),
                    torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 64)


def test_bad_arguments():
    args, _, _ = moe_inputs(4, 32, 4, 64, 32, torch.float32)
    x = torch.randn(3, 64)
    weights, ids = routing(3, 4, 2, seed=0)
    w_gate_up, w_down = args.pop("w_gate_up"), args.pop("w_down")
    with pytest.raises(ValueError, match="bits 16, 8, 6, 4"):
        fused_moe(x, w_gate_up, w_down, weights, ids, bits=3)
    with pytest.raises(ValueError, match="w_gate_up: bits=8"):
        fused_moe(x, w_gate_up, w_down, weights, ids, bits=8)
    with pytest.raises(ValueError, match="w_down: bits=4 needs scales and zeros"):
        fused_moe(x, w_gate_up, w_down, weights, ids, **{**args, "down_zeros": None})
    with pytest.raises(ValueError, match="zeros must be"):
        fused_moe(x, w_gate_up, w_down, weights, ids, **{**args, "down_zeros": args["down_zeros"][:, :8]})
    with pytest.raises(ValueError, match="group size 128"):
        fused_moe(x, w_gate_up, w_down, weights, ids, **{**args, "group_size": 128})
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w_gate_up, w_down, weights, ids[:2], **args)
    with pytest.raises(ValueError, match="w_gate_up: bits=16"):
        fused_moe(x, torch.randn(4, 64, 64, dtype=torch.bfloat16), torch.randn(4, 64, 32), weights, ids)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        fused_moe(x, w_gate_up, w_down, weights, ids, config={"BLOCK_M": 8, "SMALL": 0}, **args)
    with pytest.raises(ValueError, match="small-path"):
        fused_moe(x, w_gate_up, w_down, weights, ids, config={"SMALL": 1, "BLOCK_N": 24}, **args)
    with pytest.raises(ValueError, match="small-path"):
        fused_moe(x, w_gate_up, w_down, weights, ids, config={"SMALL": 1, "down": {"SPLIT_K": 0}}, **args)


# -- the alignment alone ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, pairs_per_program", [
    (1, 2, 8, 16, 512),
    (17, 2, 8, 16, 512),
    (64, 2, 8, 16, 16),  # eight chunks
    (45, 3, 5, 4, 32),  # five experts (BLOCK_E 8), a ragged last chunk
    (40, 1, 16, 16, 8),  # more experts than a one-hot step's rows, 11 of 16 blocks empty at most
])
def test_alignment_layout(num_tokens, top_k, num_experts, block_m, pairs_per_program):
    _, ids = routing(num_tokens, num_experts, top_k, seed=num_tokens, skip=num_experts // 2)
    layout = align_by_expert(ids, num_experts, block_m, pairs_per_program)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = layout.pair_ids.tolist()
    assert len(rows) == max_rows(num_pairs, num_experts, block_m) and int(layout.num_rows) == used
    assert sorted(p for p in rows if p != num_pairs) == list(range(num_pairs))  # every pair once
    assert all(p == num_pairs for p in rows[used:])  # the sentinel past the used rows
    blocks = layout.block_experts.tolist()
    assert blocks[used // block_m:] == [-1] * (len(blocks) - used // block_m)
    assert blocks[:used // block_m] == sorted(blocks[:used // block_m])
    for expert in range(num_experts):
        mine = [b for b, e in enumerate(blocks) if e == expert]
        assert len(mine) == -(-int(counts[expert]) // block_m)
        held = [p for b in mine for p in rows[b * block_m:(b + 1) * block_m]]
        pairs = [p for p in held if p != num_pairs]
        assert pairs == (flat == expert).nonzero().flatten().tolist()  # in order, one expert a block
        assert held == pairs + [num_pairs] * (len(held) - len(pairs))  # padding at the end of its last block


def test_alignment_of_no_pairs():
    layout = align_by_expert(torch.empty(0, 2, dtype=torch.int64), 8, 16)
    assert layout.pair_ids.numel() == 0 and layout.block_experts.numel() == 0 and int(layout.num_rows) == 0


# -- configs ---------------------------------------------------------------------------------------------
def test_default_configs_follow_rows_per_expert():
    assert fmc.default_config(128, 1536, 2048, 1, 8)["BLOCK_M"] == 16  # decode
    assert fmc.default_config(8, 28672, 4096, 128, 2)["BLOCK_M"] == 32
    assert fmc.default_config(64, 2048, 2048, 4096, 8)["BLOCK_M"] == 64
    small = fmc.default_config(4, 24, 40, 3, 2)
    assert small["BLOCK_N"] == 32 and small["BLOCK_K"] == 64  # no wider than the weights need


def test_config_lookup(monkeypatch):
    """A call's config, else the table's entry at the token bucket or the nearest tuned below, else the default;
    the down GEMM takes the gate_up's BLOCK_M."""
    gate_up_entry = {**fmc.default_config(8, 64, 32, 64, 2), "BLOCK_M": 32, "BLOCK_N": 16}
    down_entry = {**gate_up_entry, "BLOCK_M": 64, "BLOCK_N": 64}
    monkeypatch.setattr(fmc, "TUNED_CONFIGS", {(8, 64, 32, 4, 16): gate_up_entry, (8, 32, 32, 4, 16): down_entry})
    assert fmc.moe_config(8, 32, 32, 4, 64, 2) == (gate_up_entry, {**down_entry, "BLOCK_M": 32})
    assert fmc.moe_config(8, 32, 32, 4, 9, 2)[0] == gate_up_entry  # bucket 16
    assert fmc.moe_config(8, 32, 32, 4, 8, 2)[0] == fmc.default_config(8, 64, 32, 8, 2)  # nothing tuned below 16
    assert fmc.moe_config(8, 32, 32, 16, 64, 2)[0] == fmc.default_config(8, 64, 32, 64, 2)  # other bits
    gate_up, down = fmc.moe_config(8, 32, 32, 4, 64, 2, {"BLOCK_M": 16, "down": {"BLOCK_N": 32}})
    assert gate_up == {**gate_up_entry, "BLOCK_M": 16}
    assert down == {**down_entry, "BLOCK_M": 16, "BLOCK_N": 32}


def test_small_path_dispatch(monkeypatch):
    """The path: the call's SMALL, else the gate_up entry's at the bucket (or the nearest below), else the default
    (T k <= 32 and <= E); the small path's keys from the call, the table's small entry, or SMALL_DEFAULT."""
    monkeypatch.setattr(fmc, "TUNED_CONFIGS", {})
    gate_up, down = fmc.moe_config(16, 64, 32, 16, 1, 8)  # 8 pairs of 16 experts
    assert gate_up == down == fmc.SMALL_DEFAULT
    assert fmc.moe_config(128, 2048, 768, 16, 4, 8)[0]["SMALL"] == 1  # qwen3-30b-a3b: 32 pairs
    assert "SMALL" not in fmc.moe_config(128, 2048, 768, 16, 5, 8)[0]  # 40 pairs
    assert "SMALL" not in fmc.moe_config(4, 64, 32, 16, 3, 2)[0]  # 6 pairs of 4 experts
    assert fmc.moe_config(4, 64, 32, 16, 3, 2, {"SMALL": 1})[0]["SMALL"] == 1
    assert "SMALL" not in fmc.moe_config(16, 64, 32, 16, 1, 8, {"SMALL": 0})[0]
    gate_up, down = fmc.moe_config(16, 64, 32, 16, 1, 8, {"BLOCK_N": 8, "down": {"SPLIT_K": 2}})
    assert (gate_up["BLOCK_N"], gate_up["SPLIT_K"], down["BLOCK_N"], down["SPLIT_K"]) == (8, 1, 8, 2)
    small_entry = {"SMALL": 1, "BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 8}
    blocks_entry = {**fmc.default_config(16, 64, 64, 16, 8), "SMALL": 0}
    monkeypatch.setattr(fmc, "TUNED_CONFIGS", {(16, 64, 64, 16, 1): small_entry, (16, 64, 32, 16, 1): small_entry,
                                               (16, 64, 64, 16, 2): blocks_entry, (16, 64, 32, 16, 2): blocks_entry,
                                               (16, 64, 64, 16, 8): fmc.default_config(16, 64, 64, 16, 4)})
    assert fmc.moe_config(16, 64, 32, 16, 1, 4) == (small_entry, small_entry)
    assert fmc.moe_config(16, 64, 32, 16, 2, 4)[0] == blocks_entry  # 8 pairs, but the table says blocks
    assert fmc.moe_config(16, 64, 32, 16, 3, 4)[0] == blocks_entry  # bucket 4: the entry at 2
    # 16 pairs and an entry from before the small path (no SMALL): the default rule, and the small defaults
    assert fmc.moe_config(16, 64, 32, 16, 8, 2)[0] == fmc.SMALL_DEFAULT


def test_tune_searches_the_small_path_for_few_pairs(monkeypatch):
    from benchmarks import moe_kernel_tune as tune

    decode = tune.shared_configs(128, 8, 1)
    assert decode[0]["SMALL"] == 1 and any(c["SMALL"] == 0 and c["BLOCK_M"] == 16 for c in decode)
    assert {c["SPLIT_K"] for c in decode if c["SMALL"]} == set(tune.SPLITS)
    sixteen = tune.shared_configs(128, 8, 16)
    assert sixteen[0]["SMALL"] == 0 and any(c["SMALL"] for c in sixteen)  # 128 pairs: searched, blocks first
    assert all("SMALL" not in c for c in tune.shared_configs(128, 8, 64))
    assert tune.default_candidate(128, 8, 2048, 768, 1)["SMALL"] == 1
    assert all("SPLIT_K" in c for c in tune.down_configs(True))
    assert all("SPLIT_K" not in c for c in tune.down_configs(False))
    # the table's entries compete again: an old one (no SMALL) as the blocks', a small one as the small path's
    blocks = fmc.default_config(128, 1536, 2048, 1, 8)
    small = {"SMALL": 1, "BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 8}
    monkeypatch.setattr(fmc, "TUNED_CONFIGS", {(128, 1536, 2048, 16, 1): blocks, (128, 2048, 768, 16, 1): blocks,
                                               (128, 1536, 2048, 16, 2): small, (128, 2048, 768, 16, 2): small})
    assert tune.table_candidate(128, 8, 2048, 768, 16, 1) == {
        **blocks, "SMALL": 0, "down": {key: value for key, value in blocks.items() if key != "BLOCK_M"}}
    assert tune.table_candidate(128, 8, 2048, 768, 16, 3) == {
        **small, "down": {key: value for key, value in small.items() if key != "SMALL"}}
    assert tune.table_candidate(128, 8, 2048, 768, 8, 1) is None


def test_tune_writes_the_table(tmp_path):
    """benchmarks/moe_kernel_tune.py merges its winners into a table file that fused_moe_configs can read: new
    shapes added, a re-tuned one replaced, the others kept with their comments."""
    from benchmarks.moe_kernel_tune import write_table

    def result(model: str, bits: int, us: float, block_n: int) -> dict:
        config = {**fmc.default_config(4, 64, 64, 3, 2), "BLOCK_N": block_n}
        return {"model": model, "T": 3, "us": us, "default_us": 9.5,
                "gate_up": {"key": [4, 64, 64, bits, 4], "config": config},
                "down": {"key": [4, 64, 32, bits, 4], "config": config}}

    path = tmp_path / "table.py"
    write_table(str(path), [result("a", 16, 5.0, 32), result("a", 4, 6.0, 32)])
    write_table(str(path), [result("b", 16, 4.0, 64)])
    namespace: dict = {}
    exec(path.read_text(), namespace)
    table = namespace["TUNED_CONFIGS"]
    assert sorted(table) == [(4, 64, 32, 4, 4), (4, 64, 32, 16, 4), (4, 64, 64, 4, 4), (4, 64, 64, 16, 4)]
    assert table[(4, 64, 64, 16, 4)]["BLOCK_N"] == 64 and table[(4, 64, 64, 4, 4)]["BLOCK_N"] == 32
    assert "# a gate_up, T 3: the call 6.0 us (default 9.5)" in path.read_text()
    assert "# b down, T 3: the call 4.0 us (default 9.5)" in path.read_text()


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_experts_module_hands_the_kernel_its_packed_experts(bits):
    """Experts.kernel_arguments (what its CUDA forward passes) under the interpreter equals its CPU path."""
    from dflash2.models.moe import Experts

    num_experts, hidden, inter = 4, 64, 32
    fmt = None if bits == 16 else WeightFormat(bits) if bits == 8 else WeightFormat(4, 32)
    experts = Experts(num_experts, hidden, inter, fmt, fmt)
    g = torch.Generator().manual_seed(bits)
    for name, (rows, cols) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        projection = getattr(experts, name)
        floats = 0.1 * torch.randn(num_experts, rows, cols, generator=g)
        if bits == 16:
            projection.copy_(floats)
        else:
            for e in range(num_experts):
                projection.set_expert(e, quantize(floats[e], fmt))
    x = torch.randn(5, hidden, generator=g)
    weights, ids = routing(5, num_experts, 2, seed=1)
    weights_in, packed = experts.kernel_arguments()
    got = fused_moe(x, *weights_in, weights, ids, config=WIDE, **packed)
    expected = experts(x, weights, ids)
    assert float((got - expected).norm() / expected.norm()) < 1e-4


@pytest.mark.slow
def test_a_folded_float_moe_model_generates_the_unfolded_tokens(tmp_path, monkeypatch):
    """The one-row fold of a float model wired end to end (interpreted on the CPU, where the engine does not fold:
    Linear and SparseMoeBlock.fuses_norm patched to their CUDA answer): tiny Qwen3-MoE (layer 0 dense, layer 1
    sparse) in float32, the 16-bit GEMVs norming and adding, the router norming, the experts' down kernel adding;
    the same greedy tokens as the torch path with the separate norms."""
    from dflash2 import LLM, SamplingParams
    from dflash2.layers.linear import Linear
    from dflash2.models.llama import LlamaDecoderLayer
    from dflash2.models.moe import SparseMoeBlock
    from tests.tiny_models import build_tiny_model

    build_tiny_model("qwen3_moe", str(tmp_path))
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)
    calls = {"router": 0}
    fuses_norms = LlamaDecoderLayer.fuses_norms
    runs = {}
    for fused in (False, True):
        if fused:
            from dflash2.kernels.triton import moe_router

            route_normed = moe_router.moe_route_normed

            def counted(*args, **kw):
                calls["router"] += 1
                return route_normed(*args, **kw)

            monkeypatch.setattr(moe_router, "moe_route_normed", counted)
            monkeypatch.setattr(Linear, "fuses_norm", lambda self, rows: self.bias is None and rows <= 1)
            monkeypatch.setattr(SparseMoeBlock, "fuses_norm", lambda self, rows: rows <= 1)
        llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=1, kv_cache_memory="4MiB")
        layers = llm.engine.model.module.layers
        assert [fuses_norms(layer, 1) for layer in layers] == [fused, fused]
        runs[fused] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], params)]
        del llm
    assert calls["router"] == 3  # the three decode steps' sparse layer
    assert runs[True] == runs[False]
