"""The host-memory tier (L2, issue 43): a conversation whose pages the device pool evicted gets them back from
host memory on its next turn, with the tokens it would have had with no tiers (the bundled model, fp32, a
device pool of 4 pages)."""
from __future__ import annotations

from dflash2 import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FIRST = "The history of the city goes back many centuries, to a small village by the river where fishermen"
OTHERS = ["Write a poem about the sea and the wind and the stars above the quiet harbour at night time.",
          "List the planets of the solar system in order from the sun, with one fact about each of them."]


def _conversation(llm: LLM) -> tuple[list[list[int]], int]:
    """Turn one, two other prompts that take the device's pages, turn two (turn one and its answer, and more);
    every answer's tokens and turn two's reused prompt tokens."""
    first = llm.generate(FIRST, GREEDY)[0]
    others = [o.outputs[0].token_ids for o in llm.generate(OTHERS, GREEDY)]
    second_prompt = first.prompt_token_ids + list(first.outputs[0].token_ids) + llm.tokenizer.encode(" Then")
    second = llm.generate({"prompt_token_ids": second_prompt}, GREEDY)[0]
    return [first.outputs[0].token_ids, *others, second.outputs[0].token_ids], second.num_cached_tokens


def test_a_later_turn_gets_its_evicted_pages_back_from_host_memory():
    options = dict(dtype="float32", max_num_seqs=2, kv_cache_memory="4MiB", max_model_len=80)
    with LLM(**options) as llm:
        without, reused_without = _conversation(llm)
    with LLM(**options, swap_space="64MiB") as llm:
        with_l2, reused = _conversation(llm)
        kv, host = llm.engine.kv, llm.engine.host_pool
        hits_host = kv.num_prefix_hits_host
        llm.engine.pool.check()
        host.check()
    print("reused", reused_without, reused, "host hits", hits_host)
    assert with_l2 == without  # the same tokens
    assert reused_without == 0 and reused == hits_host > 0
