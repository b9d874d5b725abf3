"""overlap_max_step_tokens: in overlapped scheduling a step longer than the limit is committed alone before the
next one is planned (so what arrives while it runs can join the very next step); shorter steps keep the overlap.
The tokens are those of the plain overlapped and non-overlapped engines."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from tests.tiny_models import random_prompts

COMMON = dict(max_model_len=96, kv_cache_memory="1MiB", page_bytes=4096, prefill_chunk_size=16,
              max_num_batched_tokens=32)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens,
                                                                       temperature=0)).request_id for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = list(output.outputs[0].token_ids)
    assert engine.pool.num_used == 0
    return [finals[request_id] for request_id in ids]


def test_same_tokens_as_with_and_without_overlap(tiny_llama):
    prompts = random_prompts(6, seed=11, min_len=3, max_len=40)
    reference = greedy(LLM(tiny_llama, **COMMON, overlap=False), prompts, 9)
    assert greedy(LLM(tiny_llama, **COMMON, overlap=True), prompts, 9) == reference
    assert greedy(LLM(tiny_llama, **COMMON, overlap=True, overlap_max_step_tokens=8), prompts, 9) == reference


@pytest.mark.parametrize("limit", [None, 8])
def test_a_long_step_is_committed_before_the_next_is_planned(tiny_llama, limit):
    """A 12-token prompt: its prefill step (12 tokens) is over the limit of 8, its decode steps (1 token) are not.
    With the limit, the call after the prefill's launch commits it and launches nothing (the device idles until
    the next call plans); without it, that call launches the first decode step before committing the prefill."""
    engine = LLM(tiny_llama, **COMMON, overlap=True, overlap_max_step_tokens=limit).engine
    engine.add_request({"prompt_token_ids": list(range(3, 15))}, SamplingParams(max_tokens=4, temperature=0))
    assert engine.step() == [] and engine._in_flight is not None  # the prefill, launched
    outputs = engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1]  # the prefill's token, committed
    assert (engine._in_flight is None) == (limit is not None)
    if limit is not None:
        assert engine.step() == [] and engine._in_flight is not None  # the first decode, launched
    outputs = engine.step()  # short steps overlap in both: the second decode launched, the first committed
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2] and engine._in_flight is not None


def test_limit_below_one_is_an_error(tiny_llama):
    with pytest.raises(ValueError, match="overlap_max_step_tokens"):
        LLM(tiny_llama, overlap_max_step_tokens=0)
