"""n and best_of in the engine: the samples of a prompt share its prefilled pages, differ under sampling with a
seed, repeat from run to run, and best_of keeps the most likely; logit_bias bans a token; nothing leaks."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.engine.held_requests import HeldRequests
from dflash2.engine.parallel_sampling import sample_params
from dflash2.request import Request
from dflash2.sampling_params import SEED_RANGE


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, max_model_len=128, page_bytes=4096, kv_cache_memory="256KiB", max_num_seqs=8)


def _prompt(llm: LLM) -> list[int]:
    return list(range(3, 3 + 2 * llm.engine.kv.tokens_per_page + 5))  # two full pages and a partial one


def test_n_greedy_samples_are_identical_and_only_the_first_prefills_the_full_pages(llm):
    prompt, tokens_per_page = _prompt(llm), llm.engine.kv.tokens_per_page
    hits_before = llm.engine.kv.num_prefix_hits
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=6, temperature=0,
                                                                        ignore_eos=True))[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert output.outputs[0].token_ids == output.outputs[1].token_ids == output.outputs[2].token_ids
    single = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert single[0].outputs[0].token_ids == output.outputs[0].token_ids
    # samples 1 and 2 took the leader's two full pages; the third request took them from the cache too
    assert llm.engine.kv.num_prefix_hits - hits_before == 3 * 2 * tokens_per_page
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished()


def test_seeded_samples_differ_and_repeat(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    first = [c.token_ids for c in llm.generate({"prompt_token_ids": _prompt(llm)}, params)[0].outputs]
    again = [c.token_ids for c in llm.generate({"prompt_token_ids": _prompt(llm)}, params)[0].outputs]
    assert first == again
    assert len({tuple(tokens) for tokens in first}) == 3
    one = llm.generate({"prompt_token_ids": _prompt(llm)}, SamplingParams(max_tokens=8, temperature=1.0, seed=12,
                                                                          ignore_eos=True))
    assert one[0].outputs[0].token_ids == first[1]  # sample i draws with seed + i


def test_best_of_keeps_the_samples_of_highest_cumulative_logprob(llm):
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": _prompt(llm)}, params)[0]
    every = llm.generate({"prompt_token_ids": _prompt(llm)},
                         SamplingParams(n=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=0))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in output.outputs] == [0, 1]
    assert all(c.logprobs is None for c in output.outputs)  # not asked for
    assert llm.engine.pool.num_used == 0


def test_logit_bias_bans_the_greedy_token_and_boosts_another(llm):
    prompt = {"prompt_token_ids": _prompt(llm)}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    banned = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={greedy: -100}))
    assert banned[0].outputs[0].token_ids[0] != greedy
    boosted = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.8, seed=1, logit_bias={200: 100}))
    assert boosted[0].outputs[0].token_ids == [200, 200, 200]
    with pytest.raises(ValueError, match="logit_bias keys must be token ids in \\[0, 256\\)"):
        llm.generate(prompt, SamplingParams(logit_bias={256: 1.0}))
    with pytest.raises(ValueError, match="logit_bias values must be in \\[-100, 100\\]"):
        SamplingParams(logit_bias={1: 100.5})


def test_aborting_a_held_sample_and_its_leader_leaves_nothing(llm):
    engine = llm.engine
    leader = engine.add_request({"prompt_token_ids": _prompt(llm)}, SamplingParams(max_tokens=4), request_id="lead")
    engine.add_request({"prompt_token_ids": _prompt(llm)}, SamplingParams(max_tokens=4), request_id="held",
                       shares_prompt_with="lead")
    assert engine.num_waiting == 2 and engine.has_unfinished()
    engine.abort("held")
    engine.step()
    assert leader.num_computed_tokens > 0
    engine.abort("lead")
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_used == 0 and not engine.requests


def test_held_requests_leave_when_every_condition_holds():
    held = HeldRequests()
    a, b = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    gate = {"a": False}
    held.hold(a, lambda: gate["a"])
    held.hold(b, lambda: True)
    held.hold(b, lambda: True)
    assert [r.request_id for r in held.release()] == ["b"] and len(held) == 1
    gate["a"] = True
    assert [r.request_id for r in held.release()] == ["a"] and not held


def test_sample_params_wrap_the_seed_and_ask_logprobs_only_when_best_of_picks():
    samples = sample_params(SamplingParams(n=2, seed=SEED_RANGE[1]))
    assert [s.seed for s in samples] == [SEED_RANGE[1], SEED_RANGE[0]]
    assert [s.logprobs for s in samples] == [None, None]
    assert [s.logprobs for s in sample_params(SamplingParams(n=1, best_of=2))] == [0, 0]
    single = SamplingParams()
    assert sample_params(single) == [single] and sample_params(single)[0] is single
