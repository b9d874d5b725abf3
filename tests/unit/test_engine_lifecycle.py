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
    assert DeviceDefaults.for_device("cuda", 80 << 30) == DeviceDefaults(1024, 8192, 512)
    assert DeviceDefaults.for_device("cuda", 24 << 30) == DeviceDefaults(256, 4096, 512)
    chosen = SchedulerConfig(max_num_batched_tokens=1024).with_device_defaults("cuda", 80 << 30)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens, chosen.prefill_chunk_size) == (1024, 1024, 512)
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
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.storage.pool_bytes)
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


def test_a_request_whose_sampling_raises_ends_alone(tiny_llama):
    """A row the sampler cannot handle (a top_k past int64, set behind validation's back, as a client reached it
    before the range checks) fails its own request only: the requests in the same steps get their tokens."""
    import dataclasses

    llm = _llm(tiny_llama, max_num_seqs=4)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=6, temperature=0)
    reference = llm.generate([[5, 6, 7], [8, 9, 10, 11]], greedy)
    bad = engine.add_request({"prompt_token_ids": [12, 13]}, SamplingParams(max_tokens=6, temperature=0.8, top_k=5))
    object.__setattr__(bad.sampling_params, "top_k", 2 ** 63)
    ids = [engine.add_request({"prompt_token_ids": p}, dataclasses.replace(greedy)).request_id
           for p in ([5, 6, 7], [8, 9, 10, 11])]
    finished, failures = {}, []
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        failures += engine.take_failures()
    assert [request_id for request_id, _ in failures] == [bad.request_id] and bad.request_id not in finished
    assert [finished[i].outputs[0].token_ids for i in ids] == [r.outputs[0].token_ids for r in reference]
    assert engine.pool.num_used == 0
