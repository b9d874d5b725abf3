"""Tiny random models of each family: our engine against Hugging Face transformers (float32, CPU).

Pages hold 4 tokens and prefill chunks are 5 tokens, so every case crosses page and chunk boundaries.
"""
from __future__ import annotations

import pytest
import torch

from dflash2 import LLM, SamplingParams
from tests.engine_runs import run_with_urgent_arrivals
from tests.tiny_models import ARCHS, MOE_ARCHS, build_tiny_model, hf_greedy, hf_logprobs, random_prompts

PAGE_BYTES = 2048  # 2 layers * 2 (K,V) * 2 kv heads * 16 dims * 4 bytes = 512 bytes/token -> 4 tokens a page


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    return request.param, build_tiny_model(request.param, directory), directory


def make_llm(directory: str, arch: str, **kwargs) -> LLM:
    page_bytes = PAGE_BYTES * (2 if arch == "qwen3" else 1)  # qwen3's head_dim is 32: same 4 tokens a page
    options = dict(page_bytes=page_bytes, prefill_chunk_size=5, max_num_batched_tokens=16,
                   kv_cache_memory=256 * page_bytes)
    options.update(kwargs)
    return LLM(directory, **options)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(count, seed)


GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)  # as HF min_new_tokens: EOS masked


def test_greedy_tokens_equal_hf_across_chunks_and_pages(tiny):
    arch, hf_model, directory = tiny
    llm = make_llm(directory, arch)
    assert llm.engine.kv.tokens_per_page == 4
    batch = prompts(6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
        assert output.outputs[0].finish_reason == "length"
    assert llm.engine.pool.num_used == 0


def test_logprobs_equal_hf(tiny):
    arch, hf_model, directory = tiny
    llm = make_llm(directory, arch)
    prompt = prompts(1, seed=3)[0] + [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    output = llm.generate({"prompt_token_ids": prompt}, params)[0]
    full = prompt + output.outputs[0].token_ids
    reference = hf_logprobs(hf_model, full)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        assert prompt[position] in entry
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(reference[position - 1, token_id].item(), abs=1e-4)
    for step, entry in enumerate(output.outputs[0].logprobs):
        position = len(prompt) - 1 + step
        top = reference[position].topk(3).indices.tolist()
        assert set(top) <= set(entry)
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(reference[position, token_id].item(), abs=1e-4)


def test_prefix_cache_hits_give_the_same_tokens(tiny):
    arch, hf_model, directory = tiny
    llm = make_llm(directory, arch)
    shared = prompts(1, seed=5)[0][:3] + list(range(40, 54))  # 17 tokens: 4 full pages
    first = llm.generate({"prompt_token_ids": shared + [60]}, GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": shared + [61]}, {"prompt_token_ids": shared + [60]}], GREEDY)
    assert second[0].num_cached_tokens == 16 and second[1].num_cached_tokens == 16
    assert second[1].outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(hf_model, shared + [60], 12)
    assert second[0].outputs[0].token_ids == hf_greedy(hf_model, shared + [61], 12)


def test_preemption_gives_the_same_tokens(tiny):
    arch, hf_model, directory = tiny
    page_bytes = PAGE_BYTES * (2 if arch == "qwen3" else 1)
    llm = make_llm(directory, arch, kv_cache_memory=14 * page_bytes, max_num_batched_tokens=64, max_model_len=56)
    batch = prompts(6, seed=11)
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 16)
    assert llm.engine.pool.num_used == 0
    llm.engine.pool.check()


def test_architecture_specific_weights_are_used(tiny):
    arch, hf_model, directory = tiny
    llm = make_llm(directory, arch)
    layer = llm.engine.model.module.layers[0].self_attn
    hf_layer = hf_model.model.layers[0].self_attn
    assert (layer.qkv_bias is not None) == (arch in ("qwen2", "qwen2_moe"))
    assert (layer.q_norm is not None) == (arch in ("qwen3", "qwen3_moe", "olmoe"))
    assert torch.equal(layer.qkv_weight[: hf_layer.q_proj.weight.shape[0]], hf_layer.q_proj.weight)
    if arch in MOE_ARCHS:  # the experts stacked as transformers 5 holds them; each layer sparse or dense as there
        for ours, theirs in zip(llm.engine.model.module.layers, hf_model.model.layers):
            hf_mlp = getattr(theirs, "block_sparse_moe", None) or theirs.mlp
            assert hasattr(ours.mlp, "experts") == hasattr(hf_mlp, "experts")
            if hasattr(hf_mlp, "experts"):
                assert torch.equal(ours.mlp.experts.gate_up_proj, hf_mlp.experts.gate_up_proj)
                assert torch.equal(ours.mlp.experts.down_proj, hf_mlp.experts.down_proj)
                assert torch.equal(ours.mlp.gate.weight, hf_mlp.gate.weight)
        assert (arch == "qwen3_moe") == (not hasattr(llm.engine.model.module.layers[0].mlp, "experts"))


def test_overlapped_steps_give_the_same_tokens(tiny):
    """Overlapped scheduling (placeholders resolved a step later) on the CPU: same tokens, same stops."""
    arch, hf_model, directory = tiny
    page_bytes = PAGE_BYTES * (2 if arch == "qwen3" else 1)
    llm = make_llm(directory, arch, overlap=True, kv_cache_memory=14 * page_bytes, max_num_batched_tokens=64,
                   max_model_len=56)
    batch = prompts(6, seed=13)
    lengths = [16, 5, 9, 16, 1, 12]
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for prompt, n, output in zip(batch, lengths, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, n)
    stop_at = outputs[0].outputs[0].token_ids[3]
    stopped = llm.generate({"prompt_token_ids": batch[0]},
                           SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.outputs[0].token_ids == outputs[0].outputs[0].token_ids[:4]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_priority_preemption_with_swap_gives_the_same_tokens(tiny, overlap):
    """Urgent requests arriving mid-run pause running ones (KV to host pages and back): same tokens."""
    arch, hf_model, directory = tiny
    page_bytes = PAGE_BYTES * (2 if arch == "qwen3" else 1)
    llm = make_llm(directory, arch, kv_cache_memory=16 * page_bytes, max_num_batched_tokens=64, max_model_len=60,
                   max_num_seqs=4, swap_space=f"{64 * page_bytes}B", overlap=overlap)
    engine = llm.engine
    low = prompts(4, seed=21)
    high = prompts(3, seed=22)
    params = SamplingParams(max_tokens=14, min_tokens=14, temperature=0)
    got = run_with_urgent_arrivals(engine, low, high, params, steps_before=4)
    assert engine.scheduler.num_swap_outs > 0
    assert got == [hf_greedy(hf_model, prompt, 14) for prompt in low + high]
    assert engine.pool.num_used == 0 and engine.kv.host_pool.num_swapped == 0


@pytest.mark.parametrize("urgent_priority", [0, 9])
def test_an_outranking_first_token_is_delivered_by_the_step_that_samples_it(tiny, urgent_priority):
    """Overlapped: a step's tokens normally come out of the next step() call; a step that samples the first
    token of a request outranking another one in it is committed by the call that launched it."""
    arch, hf_model, directory = tiny
    llm = make_llm(directory, arch, overlap=True, max_num_batched_tokens=64, prefill_chunk_size=64,
                   max_model_len=60)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    low, urgent = prompts(2, seed=31)
    engine.add_request({"prompt_token_ids": low}, params)
    for _ in range(3):  # the low request is decoding (its outputs trail its steps by one call)
        engine.step()
    request = engine.add_request({"prompt_token_ids": urgent}, params, priority=urgent_priority)
    produced = [out.request_id for out in engine.step() if out.outputs[0].token_ids]
    assert (request.request_id in produced) == (urgent_priority > 0)
    first = [request.output_token_ids[0]] if urgent_priority > 0 else []
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == hf_greedy(hf_model, urgent, 8)
    assert first in ([], request.output_token_ids[:1])
