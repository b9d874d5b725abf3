"""Several models in one real server (issue 42): the bundled model at fp32, an int8 conversion and the mixed
8/4/8/6 + int8-KV conversion from a --models-config file, talked to by name with the official openai client;
loading and unloading while serving."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from dflash2 import LLM, SamplingParams
from tests.integration.server_process import API_KEY, ServerProcess

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def specs(converted_int8, converted_mixed) -> list[dict]:
    return [{"name": "fp32", "dtype": "float32"}, {"name": "int8", "path": converted_int8},
            {"name": "mixed", "path": converted_mixed}]


@pytest.fixture(scope="module")
def server(specs, tmp_path_factory):
    config = tmp_path_factory.mktemp("models") / "models.yaml"
    config.write_text(json.dumps({"models": specs}))  # JSON is YAML
    process = ServerProcess("--models-config", str(config), "--max-num-seqs", "8", "--max-model-len", "512",
                            "--api-key", API_KEY, "--disable-log-stats").start()
    yield process
    process.cleanup()


@pytest.fixture(scope="module")
def alone(specs) -> dict[str, list[str]]:
    """Each model offline, alone: the greedy text of every prompt (a step runs one model's batch, so a model's
    requests see the same numerics beside the others as alone)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = {}
    for spec in specs:
        with LLM(spec.get("path"), dtype=spec.get("dtype", "auto"), max_num_seqs=8, max_model_len=512) as llm:
            outputs[spec["name"]] = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    return outputs


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _text(client: openai.OpenAI, model: str, prompt: str) -> str:
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.model == model and completion.usage.completion_tokens == MAX_TOKENS
    return completion.choices[0].text


def test_each_model_answers_by_name_as_it_does_alone_under_mixed_traffic(server, alone):
    client = _client(server)
    jobs = [(model, index) for index in range(len(PROMPTS)) for model in alone]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _text(client, job[0], PROMPTS[job[1]]), jobs))
    for (model, index), text in zip(jobs, results):
        assert text == alone[model][index], (model, PROMPTS[index])
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"fp32", "int8", "mixed"}
    assert listed["mixed"].model_extra["kv_cache_dtype"] == "int8"
    assert listed["int8"].model_extra["weights"] == "embed 8, qkv 8, o_proj 8, ffn 8, lm_head 8 bits"
    assert server.metric("dflash2_kv_cache_used_pages") == 0  # every request done: no page held
    assert server.metric("dflash2_generation_tokens_total", model_name="mixed") == MAX_TOKENS * len(PROMPTS)


def test_a_request_must_name_one_of_the_models(server):
    client = _client(server)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist; this server serves 'fp32', 'int8', 'mixed'"):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "name one in `model`" in response.json()["error"]["message"]
    assert _text(client, "fp32", PROMPTS[0])  # still serving


def test_a_model_loads_and_unloads_while_the_others_serve(server, converted_int8):
    client, headers = _client(server), {"Authorization": f"Bearer {API_KEY}"}
    body = {"name": "extra", "path": converted_int8, "max_num_seqs": 4}
    assert httpx.post(server.url + "/v1/models", json=body).status_code == 401  # the API key guards it
    bad = [({"name": "x", "path": "/no/such/model"}, 400, "cannot load '/no/such/model'"),
           ({"name": "int8", "path": converted_int8}, 409, "a model named 'int8' is already loaded"),
           ({"name": "y"}, 400, "the model's `path`"),
           ({"name": "z", "path": converted_int8, "colour": "red"}, 400, "unknown model option(s) colour")]
    for bad_body, status, message in bad:
        response = httpx.post(server.url + "/v1/models", json=bad_body, headers=headers, timeout=120)
        assert response.status_code == status and message in response.json()["error"]["message"], response.text
    response = httpx.post(server.url + "/v1/models", json=body, headers=headers, timeout=120)
    assert response.status_code == 201 and response.json()["id"] == "extra"
    assert {m.id for m in client.models.list().data} == {"fp32", "int8", "mixed", "extra"}
    assert _text(client, "extra", PROMPTS[1]) == _text(client, "int8", PROMPTS[1])  # the same weights
    response = httpx.delete(server.url + "/v1/models/extra", headers=headers, timeout=120)
    assert response.status_code == 200 and response.json() == {"id": "extra", "object": "model", "deleted": True}
    assert httpx.delete(server.url + "/v1/models/extra", headers=headers).status_code == 404
    assert {m.id for m in client.models.list().data} == {"fp32", "int8", "mixed"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="Hi", max_tokens=2)
    assert server.wait_for_metric("dflash2_kv_cache_model_pages", lambda v: v is None, model_name="extra",
                                  state="cached") is None  # its pages went back: no gauge for it any more
    assert server.metric("dflash2_kv_cache_used_pages") == 0
    assert _text(client, "mixed", PROMPTS[2])  # the others still serve
