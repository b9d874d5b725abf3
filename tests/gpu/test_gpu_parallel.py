"""On CUDA: the parallel engine's NCCL path (issue 46). One GPU runs it as TP=1 through the executor (NCCL world of
one, the control group on gloo, the profiling step through the ranks' runners, sampled tokens broadcast into the
future-token buffer under overlapped steps) and must give the tokens of the plain engine run eager (a parallel engine
captures no CUDA graphs yet); with two GPUs, TP=2 and PP=2 agree with one process where the top two tokens are
clearly apart (bfloat16 partial sums)."""
from __future__ import annotations

import pytest
import torch

from dflash2 import LLM, SamplingParams
from tests.tiny_models import build_tiny_model, random_prompts
from tests.unit.test_parallel import WITH_LOGPROBS, assert_agrees_where_clear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("gpu-parallel") / "llama")
    build_tiny_model("llama", directory)
    return directory


def run(directory: str, params: SamplingParams, **kwargs) -> list:
    batch = [{"prompt_token_ids": p} for p in random_prompts(8, seed=2)]
    with LLM(directory, max_model_len=256, gpu_memory_utilization=0.5, **kwargs) as llm:
        return [o.outputs[0] for o in llm.generate(batch, params)]


def test_tp1_through_the_executor_gives_the_plain_engines_tokens(tiny_llama_dir):
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)
    plain = run(tiny_llama_dir, params, enforce_eager=True)
    ranks = run(tiny_llama_dir, params, distributed_executor_backend="mp")
    assert [o.token_ids for o in ranks] == [o.token_ids for o in plain]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_two_gpus_agree_with_one(tiny_llama_dir, tp, pp):
    plain = run(tiny_llama_dir, WITH_LOGPROBS, enforce_eager=True)
    split = run(tiny_llama_dir, WITH_LOGPROBS, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert_agrees_where_clear(split, plain)


def test_more_ranks_than_gpus_is_an_error_naming_the_numbers():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"= {8 * count} ranks need {8 * count} CUDA devices from cuda:0 on, but this "
                                         f"host has {count} there"):
        LLM("llama-3-8b", load_format="dummy", tensor_parallel_size=8, pipeline_parallel_size=count)
