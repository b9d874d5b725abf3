"""prompt_logprobs over HTTP (issue 40: accepted and ignored before), in vLLM's shape: a list a prompt token, the
first null, then {token id: {"logprob", "rank", "decoded_token"}}; per choice in /v1/completions, on the response
in chat and /generate; the same values as the offline API. And echo with logprobs: the prompt's tokens first."""
from __future__ import annotations

import json

import httpx
import pytest

from dflash2 import SamplingParams
from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def offline_prompt_logprobs(llm, prompt: str, num_top: int) -> list:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=num_top)
    return llm.generate(prompt, params)[0].prompt_logprobs


def assert_vllm_shape(entries: list, prompt_token_ids: list[int], num_top: int) -> None:
    assert len(entries) == len(prompt_token_ids) and entries[0] is None
    for token_id, entry in zip(prompt_token_ids[1:], entries[1:]):
        assert str(token_id) in entry  # the prompt's own token, ranked or not
        assert num_top <= len(entry) <= num_top + 1
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"} and value["rank"] >= 1
        best = max(entry.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1


def test_completions_return_prompt_logprobs_per_choice_equal_to_offline(real_server, bundled_llm_float):
    body = post(real_server, "/v1/completions", {"prompt": [PROMPT, "Hello there"], "max_tokens": 1,
                                                 "temperature": 0, "prompt_logprobs": 2})
    token_ids = bundled_llm_float.tokenizer.encode(PROMPT)
    first = body["choices"][0]["prompt_logprobs"]
    assert_vllm_shape(first, token_ids, 2)
    assert_vllm_shape(body["choices"][1]["prompt_logprobs"], bundled_llm_float.tokenizer.encode("Hello there"), 2)
    offline = offline_prompt_logprobs(bundled_llm_float, PROMPT, 2)
    for served, expected in zip(first[1:], offline[1:]):
        assert set(served) == {str(t) for t in expected}
        for token_id, logprob in expected.items():
            assert served[str(token_id)]["logprob"] == pytest.approx(logprob.logprob, abs=1e-3)
            assert served[str(token_id)]["rank"] == logprob.rank
    assert "prompt_logprobs" not in post(real_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[
        "choices"][0]


def test_chat_and_generate_return_prompt_logprobs_on_the_response(real_server, bundled_llm_float):
    chat = post(real_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    generated = post(real_server, "/generate", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3})
    assert_vllm_shape(generated["prompt_logprobs"], bundled_llm_float.tokenizer.encode(PROMPT), 3)


def test_echo_with_logprobs_covers_the_prompt_tokens_first(real_server, bundled_llm_float):
    body = post(real_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True,
                                                 "logprobs": 1})
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    num_prompt = body["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + body["usage"]["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == choice["text"] and choice["text"].startswith(PROMPT)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][num_prompt] == len(PROMPT)
    offline = offline_prompt_logprobs(bundled_llm_float, PROMPT, 1)
    token_ids = bundled_llm_float.tokenizer.encode(PROMPT)
    for i in range(1, num_prompt):
        assert logprobs["token_logprobs"][i] == pytest.approx(offline[i][token_ids[i]].logprob, abs=1e-3)


def test_generate_returns_the_logprobs_it_is_asked_for_whole_and_streamed(real_server):
    """/generate took `logprobs` and answered none."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = post(real_server, "/generate", body)
    assert len(whole["logprobs"]) == len(whole["token_ids"]) == 3
    for token_id, entry in zip(whole["token_ids"], whole["logprobs"]):
        assert str(token_id) in entry and entry[str(token_id)]["rank"] == 1 and 2 <= len(entry) <= 3
    streamed_ids, streamed_logprobs = [], []
    with httpx.stream("POST", real_server.url + "/generate", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                streamed_ids += chunk["token_ids"]
                streamed_logprobs += chunk["logprobs"]
    assert streamed_ids == whole["token_ids"]
    assert [set(e) for e in streamed_logprobs] == [set(e) for e in whole["logprobs"]]
