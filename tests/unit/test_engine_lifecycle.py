"""The engine's life: prefix pages of a request that ends in its prompt's last step stay reusable, batch sizes
chosen by device (explicit values win), and close() / dropping the last reference give everything back."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.config import DeviceDefaults, SchedulerConfig


def _llm(directory: str, **kwargs) -> LLM:
    return LLM(directory, max_model_len=128, page_bytes=4096, kv_cache_memory="64KiB", **kwargs)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_prompt_that_ends_in_its_last_prompt_step_leaves_its_pages_cached(tiny_llama, max_tokens):
    """max_tokens 1: the request finishes in the step that computed its last prompt chunk; its full pages must
    be hashed before they are released, so the same prompt again reuses them (it reused 0 tokens before)."""
    llm = _llm(tiny_llama)
    tokens_per_page = llm.engine.kv.tokens_per_page
    prompt = list(range(3, 3 + 2 * tokens_per_page + 5))  # two full pages and a partial one
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    second = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 2 * tokens_per_page
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.pool.num_used == 0


def test_batch_sizes_are_chosen_by_device_and_explicit_values_win():
    assert DeviceDefaults.for_device("cpu") == DeviceDefaults(64, 2048, 512)
    assert DeviceDefaults.for_device("cuda", 80 << 30) == DeviceDefaults(512, 8192, 512)
    assert DeviceDefaults.for_device("cuda", 24 << 30) == DeviceDefaults(256, 4096, 512)
    chosen = SchedulerConfig(max_num_batched_tokens=1024).with_device_defaults("cuda", 80 << 30)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens, chosen.prefill_chunk_size) == (512, 1024, 512)
    assert SchedulerConfig().sizes_chosen is False and chosen.sizes_chosen is True


def test_the_engine_logs_the_batch_sizes_it_chose(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="dflash2"):
        llm = _llm(tiny_llama, max_num_seqs=4)
    assert (llm.engine.scheduler.config.max_num_seqs, llm.engine.scheduler.config.max_num_batched_tokens) == (4, 2048)
    assert "max_num_seqs 4 (given), max_num_batched_tokens 2048 (device default), prefill_chunk_size 512 " \
           "(device default)" in caplog.text


def test_close_and_dropping_the_llm_free_the_engine(tiny_llama):
    threads = threading.active_count()
    with _llm(tiny_llama) as llm:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        engine = weakref.ref(llm.engine)
        runner = weakref.ref(llm.engine.runner)
    assert llm.engine is None and engine() is None and runner() is None
    llm.close()  # idempotent

    llm = _llm(tiny_llama)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.pool_bytes)
    del llm  # the last reference: no explicit close, no gc.collect() here
    assert engine() is None and pool() is None
    gc.collect()
    assert threading.active_count() == threads


def test_close_ends_requests_in_flight(tiny_llama):
    llm = _llm(tiny_llama)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50))
    engine.step()
    pool = engine.pool
    llm.close()
    assert pool.num_used == 0 and not engine.requests
