"""On a CUDA device: an engine gives its memory back (close(), or dropping the last reference), so a second
large engine starts in the same process; the batch sizes a large GPU gets by default."""
from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("release", ["close", "del"])
def test_a_second_8b_engine_starts_after_the_first_is_released(release):
    from dflash2 import LLM, SamplingParams

    before = _allocated()
    llm = LLM("llama-3-8b", load_format="dummy", gpu_memory_utilization=0.8, max_model_len=2048)
    assert llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    if release == "close":
        llm.close()
    del llm
    assert _allocated() - before <= 256 << 20
    with LLM("llama-3-8b", load_format="dummy", gpu_memory_utilization=0.8, max_model_len=2048) as second:
        assert second.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    assert _allocated() - before <= 256 << 20


def test_a_large_gpu_gets_large_batches_by_default():
    from dflash2.config import DeviceDefaults
    from dflash2.engine.model_setup import device_scheduler_config
    from dflash2.config import SchedulerConfig

    memory = torch.cuda.get_device_properties(0).total_memory
    chosen = device_scheduler_config(SchedulerConfig(), torch.device("cuda"))
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens, chosen.prefill_chunk_size) == (
        DeviceDefaults.for_device("cuda", memory).max_num_seqs,
        DeviceDefaults.for_device("cuda", memory).max_num_batched_tokens,
        DeviceDefaults.for_device("cuda", memory).prefill_chunk_size)
    if memory >= DeviceDefaults.LARGE_GPU_BYTES:
        assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (1024, 8192)
