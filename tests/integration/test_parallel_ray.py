"""The Ray executor (issue 46, item 3) on a local Ray instance of four CPUs: rank 0 in this process, ranks 1-3 Ray
actors in a placement group (TP=2 x PP=2); the same greedy tokens as one process; more ranks than the cluster's CPUs
is an error naming the numbers."""
from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from tests.tiny_models import build_tiny_model, random_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

OPTIONS = dict(page_bytes=2048, prefill_chunk_size=5, max_num_batched_tokens=16, kv_cache_memory=64 * 2048,
               max_model_len=128)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def test_ray_actors_give_the_greedy_tokens_of_one_process(tmp_path, local_ray):
    directory = str(tmp_path / "llama")
    build_tiny_model("llama", directory)
    batch = [{"prompt_token_ids": p} for p in random_prompts(4, seed=5)]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    with LLM(directory, **OPTIONS) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    with LLM(directory, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
             **OPTIONS) as llm:
        assert all("Ray actor" in llm.engine.executor.workers.describe(rank) for rank in (1, 2, 3))
        split = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert split == alone
    assert ray.is_initialized()  # the engine leaves a cluster it did not start running


def test_more_ranks_than_the_clusters_cpus_is_an_error_naming_the_numbers(tmp_path, local_ray):
    with pytest.raises(ValueError, match="= 8 ranks need 8 CPUs, but the Ray cluster has 4"):
        LLM("llama-3-8b", load_format="dummy", tensor_parallel_size=4, pipeline_parallel_size=2,
            distributed_executor_backend="ray", device="cpu")
