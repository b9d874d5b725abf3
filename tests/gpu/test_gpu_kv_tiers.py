"""On a CUDA device: the host tier (L2) with graphs and the overlapped loop: pages the device pool evicts are
copied down on the copy stream and brought back for a later turn, with the tokens of a run without tiers."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _turns(llm: LLM) -> tuple[list[list[int]], int]:
    """Four conversations' first turns (each 150 tokens: the four are more than the small pool holds),
    then each one's second turn; every answer, and the prompt tokens the second turns reused."""
    firsts = [[(13 * c + j) % 1000 + 1 for j in range(150)] for c in range(4)]
    answers = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY)]
    seconds = [first + list(answer) + [7, 8, 9] for first, answer in zip(firsts, answers)]
    outs = llm.generate([{"prompt_token_ids": p} for p in seconds], GREEDY)
    return answers + [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def test_later_turns_come_back_from_host_memory_with_the_same_tokens():
    """Against a device pool large enough to keep every page: the second turns reuse the same bytes (from host
    memory instead of the device), so their tokens are equal (a recompute would not be, in bf16: a prefix's KV
    from its decode steps differs in its last bits from the same tokens' prefill). One request at a time in both
    runs, so every step's batch is the same too (bf16 matmuls of other batch sizes may round differently)."""
    options = dict(load_format="dummy", max_num_seqs=1, max_model_len=300)  # one at a time: equal batches
    with LLM("qwen3-0.6b", **options, kv_cache_memory="512MiB") as llm:
        kept, reused_kept = _turns(llm)
    with LLM("qwen3-0.6b", **options, kv_cache_memory="40MiB", swap_space="256MiB") as llm:
        assert llm.engine.overlap and llm.engine.runner.graphs is not None
        with_l2, reused = _turns(llm)
        llm.engine.pool.check()
        llm.engine.host_pool.check()
        hits_host = llm.engine.kv.num_prefix_hits_host
    assert with_l2 == kept
    assert hits_host > 0 and reused == reused_kept
