"""The Ray executor (issue 46, item 3) on a local Ray instance: rank 0 in this process, rank 1 a Ray actor in a
placement group of two CPU bundles; the same greedy tokens as one process, and the actor's end when the engine
closes."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from tests.tiny_models import build_tiny_model, random_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_ray_actors_give_the_greedy_tokens_of_one_process(tmp_path):
    directory = str(tmp_path / "llama")
    build_tiny_model("llama", directory)
    batch = [{"prompt_token_ids": p} for p in random_prompts(4, seed=5)]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    options = dict(page_bytes=2048, prefill_chunk_size=5, max_num_batched_tokens=16, kv_cache_memory=64 * 2048, max_model_len=128)
    with LLM(directory, **options) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    llm = LLM(directory, tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    try:
        assert "Ray actor" in llm.engine.executor.workers.describe(1)
        split = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    finally:
        llm.close()
    assert split == alone
    assert not ray.is_initialized()  # the local instance it started is gone with it
