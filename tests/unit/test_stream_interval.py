"""stream_interval: a streamed request's outputs every N tokens (the first and the last at once), the same
tokens and text as every step's outputs."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams


def streamed(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list]:
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p},
                              SamplingParams(max_tokens=n, min_tokens=n, temperature=0)).request_id
           for p, n in zip(prompts, max_tokens)]
    seen = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert engine.pool.num_used == 0
    return [seen[request_id] for request_id in ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_come_every_n_tokens_with_every_token_in_them(tiny_llama, overlap):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]
    max_tokens = [8, 2, 7]
    common = dict(max_model_len=64, kv_cache_memory="1MiB", page_bytes=4096, overlap=overlap)
    every = streamed(LLM(tiny_llama, **common), prompts, max_tokens)
    batched = streamed(LLM(tiny_llama, **common, stream_interval=3), prompts, max_tokens)
    # 8 tokens: the first, then 2-4, 5-7, and the last; 2 tokens: both at once; 7: 1, 2-4, 5-7 (finished)
    assert [[len(o.delta_token_ids) for o in outs] for outs in batched] == [[1, 3, 3, 1], [1, 1], [1, 3, 3]]
    assert [[len(o.delta_token_ids) for o in outs] for outs in every] == [[1] * n for n in max_tokens]
    for mine, reference in zip(batched, every):
        assert mine[-1].finished and not any(o.finished for o in mine[:-1])
        tokens = [t for o in mine for t in o.delta_token_ids]
        assert tokens == list(mine[-1].outputs[0].token_ids) == list(reference[-1].outputs[0].token_ids)
        assert "".join(o.delta_text for o in mine) == mine[-1].outputs[0].text == reference[-1].outputs[0].text


def test_stream_interval_below_one_is_an_error(tiny_llama):
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(tiny_llama, stream_interval=0)
