"""Several models on one page pool (issue 42), offline: the bundled model at fp32, an int8 conversion and the mixed
8/4/8/6 + int8-KV conversion in one engine."""
from __future__ import annotations

import gc
import weakref

import pytest

from dflash2 import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are", "Water boils at", "My favourite book is"]
MODELS = ("fp32", "int8", "mixed")


def _specs(int8_dir: str, mixed_dir: str) -> list[dict]:
    return [{"name": "fp32", "dtype": "float32"}, {"name": "int8", "path": int8_dir},
            {"name": "mixed", "path": mixed_dir}]


def _run(engine, requests: list[tuple[str, str, int]], params: SamplingParams = GREEDY,
         on_step=None) -> dict[str, list[int]]:
    """Add (model, prompt, priority) requests, step to the end checking the pool after every step; output tokens
    by request id."""
    ids = [engine.add_request(prompt, params, priority, model=model).request_id
           for model, prompt, priority in requests]
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        engine.pool.check()  # free + cached + used == total, per model too
        if engine.host_pool is not None:
            assert engine.host_pool.num_free + engine.host_pool.num_swapped == engine.host_pool.num_pages
        if on_step is not None:
            on_step(engine)
    return {request_id: finished[request_id] for request_id in ids}


@pytest.fixture(scope="module")
def alone(converted_int8, converted_mixed) -> dict[str, list[list[int]]]:
    """Each model served alone: the greedy tokens of every prompt."""
    outputs = {}
    for spec in _specs(converted_int8, converted_mixed):
        with LLM(spec.get("path"), dtype=spec.get("dtype", "auto"), max_num_seqs=8) as llm:
            outputs[spec["name"]] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return outputs


@pytest.fixture(scope="module")
def together(converted_int8, converted_mixed):
    with LLM(models=_specs(converted_int8, converted_mixed), max_num_seqs=8, swap_space="64MiB") as llm:
        yield llm


def test_each_model_under_mixed_traffic_equals_the_model_alone(together, alone):
    engine = together.engine
    assert {name: served.layout.kv_dtype for name, served in engine.models.items()} == \
        {"fp32": "fp32", "int8": "fp32", "mixed": "int8"}  # one pool, three page layouts
    requests = [(model, prompt, 0) for i, prompt in enumerate(PROMPTS) for model in MODELS[i % 3:] + MODELS[:i % 3]]
    stepped = []
    outputs = _run(engine, requests, on_step=lambda e: stepped.append(e.last_model))
    assert set(stepped) == set(MODELS)
    for (model, prompt, _), tokens in zip(requests, outputs.values()):
        assert tokens == alone[model][PROMPTS.index(prompt)], (model, prompt)
    assert engine.pool.num_used == 0
    assert together.generate(PROMPTS[:1], GREEDY, model="mixed")[0].outputs[0].token_ids == alone["mixed"][0]


def test_a_request_without_a_model_is_refused_when_several_are_loaded(together):
    with pytest.raises(ValueError, match=r"several models are loaded \(fp32, int8, mixed\): name one"):
        together.generate("Hello", GREEDY)
    with pytest.raises(ValueError, match="no model named 'nope' is loaded; loaded: fp32, int8, mixed"):
        together.generate("Hello", GREEDY, model="nope")
    assert together.engine.requests == {}


def test_no_model_starves_behind_urgent_work_of_another(together):
    """fp32's requests at priority 1000 keep it the most urgent model; int8's priority-0 request still steps at least
    once every max_model_skip_steps + 1 steps."""
    engine = together.engine
    bound = engine.config.max_model_skip_steps
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt, params, 1000, model="fp32").request_id for prompt in PROMPTS[:4]]
    low = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), 0,
                             model="int8").request_id
    since_low, longest, low_done = 0, 0, False
    while engine.has_unfinished():
        for output in engine.step():
            low_done |= output.request_id == low and output.finished
        if engine.last_model == "int8":
            since_low = 0
        elif not low_done:
            since_low += 1
            longest = max(longest, since_low)
    assert low_done and 0 < longest <= bound
    assert all(request_id not in engine.requests for request_id in ids)


def test_an_urgent_request_to_one_model_preempts_bulk_requests_of_another(converted_int8):
    """A pool of 10 pages of 1 MiB (22 fp32 tokens each): fp32's two bulk requests grow to take it all; an urgent
    int8 request pauses one of them (its KV swapped to host pages) and runs at once, and everyone's tokens are
    those of the models alone."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    story = " ".join(["The history of the city goes back many centuries."] * 5)
    bulk = [f"Chapter {i}. {story}" for i in (1, 2)]
    specs = [{"name": "fp32", "dtype": "float32"}, {"name": "int8", "path": converted_int8}]
    with LLM(None, dtype="float32", max_num_seqs=8, kv_cache_memory="10MiB", max_model_len=200) as llm:
        bulk_alone = [o.outputs[0].token_ids for o in llm.generate(bulk, params)]
        assert llm.engine.scheduler.num_preemptions == 0
    with LLM(converted_int8, max_num_seqs=8) as llm:
        urgent_alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    with LLM(models=specs, max_num_seqs=8, kv_cache_memory="10MiB", swap_space="64MiB", max_model_len=200) as llm:
        engine = llm.engine
        fp32 = engine.models["fp32"].scheduler
        ids = [engine.add_request(prompt, params, 0, model="fp32").request_id for prompt in bulk]
        finished = {}
        while engine.pool.available_for("int8") > 0:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.pool.check()
        assert not finished and fp32.num_preemptions == 0 and len(fp32.running) == 2
        urgent = engine.add_request(PROMPTS[0], params, 1000, model="int8").request_id
        engine.step()
        assert engine.last_model == "int8" and urgent in engine.models["int8"].scheduler.running
        assert fp32.num_preemptions == 1 and fp32.num_swap_outs == 1 and len(fp32.running) == 1
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.pool.check()
        assert finished[urgent].outputs[0].token_ids == urgent_alone
        assert [finished[i].outputs[0].token_ids for i in ids] == bulk_alone
        assert engine.pool.num_used == 0 and engine.host_pool.num_swapped == 0


def test_a_model_loaded_and_unloaded_at_runtime_returns_every_page_and_its_weights(together, converted_int8):
    engine = together.engine
    free_before = engine.pool.num_free + engine.pool.num_cached
    name = together.load_model(converted_int8, name="extra", max_num_seqs=4)
    assert name == "extra" and together.model_names == [*MODELS, "extra"]
    with pytest.raises(ValueError, match="a model named 'extra' is already loaded"):
        together.load_model(converted_int8, name="extra")
    with pytest.raises(ValueError):
        together.load_model("/no/such/model", name="missing")
    assert together.model_names == [*MODELS, "extra"]
    story = " ".join(["The history of the city goes back many centuries."] * 5)  # full pages: cached after
    outputs = _run(engine, [("extra", f"{prompt} {story}", 0) for prompt in PROMPTS[:3]] + [("fp32", PROMPTS[3], 0)])
    assert len(outputs) == 4 and engine.pool.num_cached_by("extra") > 0
    weights = weakref.ref(engine.models["extra"].model.module)
    request = engine.add_request(PROMPTS[0], GREEDY, model="extra")
    with pytest.raises(ValueError, match="model 'extra' still has 1 requests"):
        together.unload_model("extra")
    together.unload_model("extra", force=True)
    gc.collect()
    assert weights() is None and request.request_id not in engine.requests
    assert together.model_names == list(MODELS)
    assert engine.pool.num_used_by("extra") == 0 and engine.pool.num_cached_by("extra") == 0
    assert engine.pool.num_free + engine.pool.num_cached == free_before == engine.pool.num_pages
    engine.pool.check()
