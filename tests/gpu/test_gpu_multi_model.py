"""On a CUDA device: two models of different formats on one page pool, each with its own CUDA graphs, stepped by
the overlapped loop in turns; each equals itself alone, an urgent request to one swaps out another's, and a model
loaded and unloaded while the other runs gives its memory back."""
from __future__ import annotations

import gc

import pytest
import torch

from dflash2 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SPECS = [{"name": "small", "path": "smollm2-135m", "load_format": "dummy"},
         {"name": "qwen-int8", "path": "qwen3-0.6b", "load_format": "dummy", "quantization": "int8"}]
PROMPTS = [[(7 * i + j) % 1000 + 1 for j in range(20 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _alone(spec: dict) -> list[list[int]]:
    options = {k: v for k, v in spec.items() if k not in ("name", "path")}
    with LLM(models=[{"name": spec["name"], "path": spec["path"], **options}], max_num_seqs=16,
             kv_cache_memory="256MiB", max_model_len=1024) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, model=spec["name"])]


def test_two_models_on_one_pool_with_graphs_and_overlap_equal_each_alone():
    alone = {spec["name"]: _alone(spec) for spec in SPECS}
    with LLM(models=SPECS, max_num_seqs=16, kv_cache_memory="512MiB", max_model_len=1024) as llm:
        engine = llm.engine
        assert engine.overlap and all(m.runner.graphs is not None for m in engine.models.values())
        ids = {(name, i): engine.add_request({"prompt_token_ids": p}, GREEDY, model=name).request_id
               for i, p in enumerate(PROMPTS) for name in alone}
        finished, stepped = {}, []
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            stepped.append(engine.last_model)
            engine.pool.check()
        assert set(stepped) == set(alone)
        for (name, i), request_id in ids.items():
            assert finished[request_id].outputs[0].token_ids == alone[name][i], (name, i)
        assert engine.pool.num_used == 0


def test_an_urgent_request_swaps_out_another_models_requests_on_the_gpu():
    """48 pages of 1 MiB: 9 tokens of qwen3-0.6b each, so its six 100-token prompts take them all at once."""
    long_prompts = [[(11 * i + j) % 900 + 1 for j in range(100)] for i in range(6)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with LLM(models=SPECS, max_num_seqs=16, kv_cache_memory="48MiB", swap_space="256MiB",
             max_model_len=400) as llm:
        engine = llm.engine
        bulk = engine.models["qwen-int8"].scheduler
        for prompt in long_prompts:
            engine.add_request({"prompt_token_ids": prompt}, params, 0, model="qwen-int8")
        finished = {}
        while engine.pool.available_for("small") > 0 and engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert engine.pool.available_for("small") == 0 and not finished
        urgent = engine.add_request({"prompt_token_ids": PROMPTS[0]}, params, 1000, model="small").request_id
        swap_outs = bulk.num_swap_outs
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert engine.last_model == "small" and urgent in engine.models["small"].scheduler.running
        assert bulk.num_swap_outs > swap_outs  # its pages came from the other model's requests
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.pool.check()
        assert len(finished) == 7
        assert engine.pool.num_used == 0 and engine.host_pool.num_swapped == 0
    with LLM(models=[SPECS[0]], max_num_seqs=16, kv_cache_memory="48MiB", max_model_len=400) as llm:
        assert finished[urgent].outputs[0].token_ids == llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids


def test_a_model_loaded_and_unloaded_beside_another_gives_its_memory_back():
    with LLM(models=SPECS[:1], max_num_seqs=16, kv_cache_memory="256MiB", max_model_len=1024) as llm:
        before = _allocated()
        llm.load_model("qwen3-0.6b", name="extra", load_format="dummy", quantization="int8")
        assert _allocated() - before > 200 << 20  # its weights and graphs
        out = llm.generate(PROMPTS[:2], GREEDY, model="extra")
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
        llm.unload_model("extra")
        assert _allocated() - before <= 64 << 20
        assert llm.generate(PROMPTS[:1], GREEDY, model="small")[0].outputs[0].token_ids == _alone(SPECS[0])[0]


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()
