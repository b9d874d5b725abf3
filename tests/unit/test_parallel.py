"""Tensor and pipeline parallelism on the CPU (issue 46): real worker processes over gloo give the greedy tokens of one
process, for tiny models of each family (float32, int8, int4), across chunked prefill and preemption (recompute and
swap, plain and overlapped steps); the bundled model too. Plus the splits refused with the numbers, the packed
slicing, and a hung worker found by its heartbeat.

Each parallel engine's workers start once and serve one batch that crosses page and chunk boundaries and preempts.
Exact token equality holds for the float32 models: the all-reduce sums partial products in another order than one
process, so logits differ in their last bits (logprobs within 1e-4), and these models' top two tokens are further
apart than that. The int8 and int4 cases compare tokens where one process's top two are CLEAR_MARGIN apart and
logprobs within LOGPROB_DRIFT: their CPU kernels compute in bfloat16, so each rank's partial sum is rounded before the
all-reduce (the bundled model's GGUF int4 weights at TP=3 drift by about 0.1 nats so; it runs here as float32).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.cli.main import main as dflash2_main
from dflash2.config import ModelArchConfig
from dflash2.engine.config import EngineConfig
from dflash2.engine.engine import Engine
from dflash2.engine.kv.layout import KVLayout
from dflash2.layers.quant_linear import QuantLinear
from dflash2.parallel.config import ParallelConfig
from dflash2.parallel.errors import WorkerFailed
from dflash2.parallel.shard import ShardPlan, check_fits, local_layout, stage_layers, take_columns, take_rows
from dflash2.quantization.formats import WeightFormat
from dflash2.quantization.quantize import quantize
from tests.tiny_models import build_tiny_model, hf_config, random_prompts

PAGE_BYTES = 2048  # 4 tokens a page for the tiny models (head_dim 16; qwen3's 32 takes twice the bytes)
GREEDY = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)


def arch(**overrides) -> ModelArchConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    return ModelArchConfig(**{**fields, **overrides})


# -- no processes -----------------------------------------------------------------------------------------
def test_parallel_config_names_what_is_wrong():
    assert ParallelConfig().backend == "uni" and not ParallelConfig().uses_executor
    assert ParallelConfig(2, 2).backend == "mp" and ParallelConfig(2, 2).world_size == 4
    assert ParallelConfig(distributed_executor_backend="mp").uses_executor  # TP=1 through the executor
    assert ParallelConfig(ray_address="auto").backend == "ray"
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="'uni' runs one process.*needs 2 ranks"):
        ParallelConfig(2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="ray_address is for distributed_executor_backend 'ray'"):
        ParallelConfig(ray_address="auto", distributed_executor_backend="mp")


@pytest.mark.parametrize("overrides, tp, pp, message", [
    ({}, 3, 1, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
    ({"num_heads": 8, "num_kv_heads": 2}, 8, 1, None),  # KV heads replicated: 8 ranks, 2 KV heads
    ({"num_heads": 12, "num_kv_heads": 6}, 4, 1, "tensor_parallel_size 4 does not divide the model's 6 KV heads"),
    ({"num_heads": 6, "num_kv_heads": 2}, 3, 1, "tensor_parallel_size 3 is not a multiple of the model's 2 KV heads"),
    ({"intermediate_size": 90}, 4, 1, "tensor_parallel_size 4 does not divide the model's intermediate size 90"),
    ({}, 1, 3, "pipeline_parallel_size 3 is more than the model's 2 layers"),
])
def test_splits_a_model_does_not_allow_are_errors_naming_the_numbers(overrides, tp, pp, message):
    model = arch(**overrides)
    if message is None:
        check_fits(model, ParallelConfig(tp, pp))
        return
    with pytest.raises(ValueError, match=message):
        check_fits(model, ParallelConfig(tp, pp))


def test_stages_and_each_ranks_part():
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    plans = [ShardPlan.of(arch(num_heads=8, num_kv_heads=2, vocab_size=250), ParallelConfig(4, 2), rank)
             for rank in range(8)]
    assert [p.heads for p in plans[:4]] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [p.kv_heads for p in plans[:4]] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # each KV head on two ranks
    assert [p.vocab for p in plans[:4]] == [(0, 63), (63, 126), (126, 189), (189, 250)]
    assert {p.layers for p in plans[:4]} == {(0, 1)} and {p.layers for p in plans[4:]} == {(1, 2)}


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_each_rank_pages_hold_the_same_tokens_in_their_part_of_the_bytes(kv_dtype):
    model = arch(num_layers=4, num_kv_heads=4, num_heads=4)
    full = KVLayout.for_model(model, kv_dtype, 1 << 16)
    plan = ShardPlan.of(model, ParallelConfig(2, 2), 3)
    part = local_layout(full, plan)
    assert (part.num_layers, part.num_kv_heads, part.tokens_per_page) == (2, 2, full.tokens_per_page)
    assert part.page_bytes <= full.page_bytes // 4 + 4


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_packed_weights_are_sliced_by_rows_and_on_group_boundaries(bits):
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    fmt = WeightFormat(bits, None if bits == 8 else 32)
    layer = QuantLinear(128, 48, fmt)
    layer.set_packed(quantize(weight, fmt))
    whole = layer.dequantized()
    take_rows(layer, [(0, 8), (24, 32)])
    take_columns(layer, 32, 96, "test")
    assert (layer.out_features, layer.in_features) == (16, 64)
    expected = torch.cat([whole[0:8], whole[24:32]])[:, 32:96]
    assert torch.equal(layer.dequantized(), expected)
    if bits != 8:
        with pytest.raises(ValueError, match=f"test: .*cutting an int{bits} group of 32"):
            take_columns(layer, 16, 48, "test")


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_experts_are_sliced_on_their_intermediate_features(bits):
    from dflash2.models.moe import Experts
    from dflash2.parallel.shard import shard_experts

    torch.manual_seed(0)
    fmt = WeightFormat(bits, None if bits == 8 else 32)
    experts = Experts(2, 64, 128, fmt, fmt)  # gate_up [2, 256, 64], down [2, 64, 128]
    for e in range(2):
        experts.gate_up_proj.set_expert(e, quantize(torch.randn(256, 64), fmt))
        experts.down_proj.set_expert(e, quantize(torch.randn(64, 128), fmt))
    whole = [(experts.gate_up_proj.dequantized(e), experts.down_proj.dequantized(e)) for e in range(2)]
    plan = ShardPlan.of(arch(), ParallelConfig(2), 1)  # the second of two ranks: intermediate features 64..128
    shard_experts(experts, plan, "test")
    for e, (gate_up, down) in enumerate(whole):
        assert torch.equal(experts.gate_up_proj.dequantized(e), torch.cat([gate_up[64:128], gate_up[192:256]]))
        assert torch.equal(experts.down_proj.dequantized(e), down[:, 64:128])


def test_a_split_of_the_bundled_model_fails_before_any_worker_starts():
    started = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 9 attention heads"):
        LLM(tensor_parallel_size=2)
    assert time.monotonic() - started < 30
    assert dflash2_main(["generate", "--prompt", "Hi", "--tensor-parallel-size", "2"]) == 2


# -- tiny models on worker processes ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Directories of tiny models, built on first use: HF families, a one-KV-head Llama, converted int8 / int4."""
    root = tmp_path_factory.mktemp("parallel")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            directory = str(root / name)
            if name == "llama-kv1":
                from transformers import AutoModelForCausalLM

                torch.manual_seed(0)
                config = hf_config("llama")
                config.num_key_value_heads = 1
                AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
            elif "-int" in name:  # FAMILY-intBITS: converted (a MoE's experts too; its router stays 16-bit)
                family, bits = name.rsplit("-", 1)
                flags = ["--dtype", bits] + (["--group-size", "32"] if bits == "int4" else [])
                assert dflash2_main(["convert", "--model-path", get(family), "--output-path", directory,
                                     "--no-progress", *flags]) == 0
            else:
                build_tiny_model(name, directory)
            built[name] = directory
        return built[name]

    return get


def options(name: str, **overrides) -> dict:
    page_bytes = PAGE_BYTES * (2 if name == "qwen3" else 1)
    return {**dict(page_bytes=page_bytes, prefill_chunk_size=5, max_num_batched_tokens=64, max_model_len=56,
                   kv_cache_memory=14 * page_bytes), **overrides}


def greedy(directory: str, batch: list[list[int]], params: SamplingParams = GREEDY, **kwargs) -> tuple[list, int]:
    """(each prompt's CompletionOutput, preemptions)."""
    with LLM(directory, **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        assert llm.engine.pool.num_used == 0
        return [o.outputs[0] for o in outputs], llm.engine.scheduler.num_preemptions


CASES = {  # name: (model, tensor, pipeline, extra options)
    "llama-tp2": ("llama", 2, 1, {}),
    "llama-pp2": ("llama", 1, 2, {}),
    "llama-tp2xpp2-overlap-swap": ("llama", 2, 2, {"overlap": True, "swap_space": "64KiB"}),
    "llama-kv1-tp2": ("llama-kv1", 2, 1, {}),
    "qwen2-tp2-swap": ("qwen2", 2, 1, {"swap_space": "64KiB"}),
    "qwen3-tp2": ("qwen3", 2, 1, {}),
    "qwen2_moe-tp2": ("qwen2_moe", 2, 1, {}),
    "olmoe-tp2": ("olmoe", 2, 1, {}),
    "mixtral-pp2-overlap": ("mixtral", 1, 2, {"overlap": True}),
    "llama-int8-tp2": ("llama-int8", 2, 1, {}),
    "llama-int4-tp2xpp2": ("llama-int4", 2, 2, {}),
    "qwen2_moe-int8-tp2": ("qwen2_moe-int8", 2, 1, {}),
}
HEAVY = {"llama-tp2xpp2-overlap-swap", "llama-int4-tp2xpp2", "mixtral-pp2-overlap"}


QUANTIZED = {"llama-int8-tp2", "llama-int4-tp2xpp2", "qwen2_moe-int8-tp2"}  # bfloat16 CPU kernels: compared within a tolerance
CLEAR_MARGIN = 0.25  # nats between the top two tokens: where the quantized cases' tokens must agree
LOGPROB_DRIFT = 0.25  # nats: bfloat16 partial sums (the int8 MoE: mean 0.025, at most 0.19, a router near tie)
WITH_LOGPROBS = SamplingParams(max_tokens=16, min_tokens=16, temperature=0, logprobs=2)


def assert_agrees_where_clear(split: list, alone: list) -> None:
    """Greedy outputs of a split quantized model against one process's: the same tokens wherever one process's top
    two are CLEAR_MARGIN apart (a near tie may go the other way, and the sequences part there), logprobs within
    LOGPROB_DRIFT up to there, and most sequences the same throughout."""
    for ours, theirs in zip(split, alone):
        for index, (mine, token) in enumerate(zip(ours.token_ids, theirs.token_ids)):
            entries = theirs.logprobs[index]
            if mine != token:
                top = sorted((entry.logprob for entry in entries.values()), reverse=True)
                assert top[0] - top[1] < CLEAR_MARGIN
                break
            assert ours.logprobs[index][token].logprob == pytest.approx(entries[token].logprob, abs=LOGPROB_DRIFT)
    assert sum(o.token_ids == t.token_ids for o, t in zip(split, alone)) >= len(alone) // 2


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.slow) if name in HEAVY else name
                                  for name in CASES])
def test_parallel_engines_give_the_greedy_tokens_of_one_process(tiny, case):
    name, tp, pp, extra = CASES[case]
    directory = tiny(name)
    batch = random_prompts(6, seed=11)
    params = WITH_LOGPROBS if case in QUANTIZED else GREEDY
    alone, _ = greedy(directory, batch, params, **options(name, **extra))
    split, preemptions = greedy(directory, batch, params, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                **options(name, **extra))
    assert preemptions > 0
    if case in QUANTIZED:
        assert_agrees_where_clear(split, alone)
    else:
        assert [o.token_ids for o in split] == [o.token_ids for o in alone]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_logprobs_and_prompt_logprobs_match_one_process(tiny, tp, pp):
    directory = tiny("llama")
    prompt = random_prompts(1, seed=3)[0] + [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    with LLM(directory, **options("llama")) as llm:
        alone = llm.generate({"prompt_token_ids": prompt}, params)[0]
    with LLM(directory, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options("llama")) as llm:
        split = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert split.outputs[0].token_ids == alone.outputs[0].token_ids
    pairs = list(zip(split.prompt_logprobs[1:], alone.prompt_logprobs[1:])) + list(
        zip(split.outputs[0].logprobs, alone.outputs[0].logprobs))
    assert len(pairs) == len(prompt) - 1 + 6
    for ours, theirs in pairs:
        assert ours.keys() == theirs.keys()
        for token_id, entry in ours.items():
            assert entry.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)


def test_int4_groups_cut_by_the_split_are_an_error_naming_the_layer(tiny, tmp_path):
    out = str(tmp_path / "int4-g64")
    assert dflash2_main(["convert", "--model-path", tiny("llama"), "--output-path", out, "--no-progress",
                         "--dtype", "int4", "--group-size", "64"]) == 0
    with pytest.raises(ValueError, match="layer 0 o_proj: tensor parallelism would split its 64 input features at "
                                         "0..32, cutting an int4 group of 64"):
        LLM(out, tensor_parallel_size=2, **options("llama"))


def test_a_hung_worker_is_found_by_its_heartbeat_and_steps_fail_naming_it(tiny):
    directory = tiny("llama")
    config = EngineConfig(model=directory, parallel=ParallelConfig(2, heartbeat_timeout_s=3.0))
    engine = Engine(config)
    try:
        pid = engine.executor.workers.pid(1)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while engine.executor.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "worker rank 1" in engine.executor.failure and "sent no heartbeat" in engine.executor.failure
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
        with pytest.raises(WorkerFailed, match="worker rank 1 .* sent no heartbeat"):
            engine.step()
        assert engine.executor.workers.problem(1) is not None  # killed
    finally:
        engine.close()


BUNDLED_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# its GGUF weights as float32 (as int4 they run on bfloat16 kernels, whose rounded partial sums drift ~0.1 nats)
BUNDLED_OPTIONS = dict(max_model_len=128, max_num_seqs=4, prefill_chunk_size=4, dtype="float32")
BUNDLED_PARAMS = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def bundled_alone() -> list:
    with LLM(**BUNDLED_OPTIONS) as llm:
        return [o.outputs[0] for o in llm.generate(BUNDLED_PROMPTS, BUNDLED_PARAMS)]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(3, 1), (1, 2)])  # its 9 heads and 3 KV heads: 3 ranks (2 is refused above)
def test_the_bundled_model_split_gives_the_tokens_of_one_process(bundled_alone, tp, pp):
    with LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, **BUNDLED_OPTIONS) as llm:
        split = [o.outputs[0] for o in llm.generate(BUNDLED_PROMPTS, BUNDLED_PARAMS)]
    assert [o.token_ids for o in split] == [o.token_ids for o in bundled_alone]
    for ours, theirs in zip(split, bundled_alone):
        for token, mine, reference in zip(theirs.token_ids, ours.logprobs, theirs.logprobs):
            assert mine[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)
