"""Bad input to the real server: OpenAI-style 400s, 413, 401; never a 500 and never a crash."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GENERATION_ENDPOINTS = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    "/generate": {"prompt": "Hello", "max_tokens": 2},
}


def post(server, path: str, body=None, content: bytes | None = None, headers=None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, headers={**AUTH, **(headers or {})},
                      timeout=60)


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize("path", list(GENERATION_ENDPOINTS))
def test_malformed_json_is_400(real_server, path):
    response = post(real_server, path, content=b'{"prompt": "Hello", "max_tokens": ', headers={
        "Content-Type": "application/json"})
    assert_openai_error(response, 400, "not valid JSON")
    assert_openai_error(post(real_server, path, content=b"[1, 2]"), 400, "JSON object")


@pytest.mark.parametrize("path", list(GENERATION_ENDPOINTS))
@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", "ten", ("max_tokens",)),
    ("max_tokens", -5, ("max_tokens", "-5")),
    ("max_tokens", 0, ("max_tokens",)),
    ("temperature", "hot", ("temperature",)),
    ("priority", -1, ("priority",)),
    ("priority", 65536, ("priority", "65535")),
    ("priority", "high", ("priority",)),
    ("stream", "yes", ("stream",)),
    ("model", "gpt-4", ("gpt-4", "does not exist")),
    ("top_p", 0.0, ("top_p",)),
    ("stop_token_ids", [10 ** 9], ("stop_token_ids",)),
])
def test_bad_fields_are_400(real_server, path, field, value, words):
    error = assert_openai_error(post(real_server, path, {**GENERATION_ENDPOINTS[path], field: value}), 400, *words)
    if field == "model":
        assert error["code"] == "model_not_found"


def test_wrong_prompt_types_are_400(real_server):
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": 5}), 400, "prompt")
    assert_openai_error(post(real_server, "/v1/completions", {"max_tokens": 5}), 400, "prompt", "required")
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": [10 ** 9]}), 400, "token id")
    assert_openai_error(post(real_server, "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert_openai_error(post(real_server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_openai_error(post(real_server, "/generate", {"max_tokens": 5}), 400, "prompt")
    assert_openai_error(post(real_server, "/generate", {"prompt": "a", "prompt_token_ids": [1]}), 400, "one of")
    assert_openai_error(post(real_server, "/detokenize", {"tokens": [-1]}), 400, "token id")
    assert_openai_error(post(real_server, "/tokenize", {"prompt": 3}), 400, "prompt")


def test_unsupported_fields_are_400_not_ignored(real_server):
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": "Hi", "n": 2}), 400, "n must be 1")
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": "Hi", "logit_bias": {"1": 5.0}}), 400,
                        "logit_bias")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert_openai_error(post(real_server, "/v1/chat/completions",
                             {**GENERATION_ENDPOINTS["/v1/chat/completions"], "tools": tools}), 400, "tools")


def test_prompt_longer_than_context_is_400_with_both_numbers(real_server):
    prompt = "hello " * 1200  # 1200 tokens; the server runs with --max-model-len 1024
    for path, body in (("/v1/completions", {"prompt": prompt}), ("/generate", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
        error = assert_openai_error(post(real_server, path, body), 400, "1024")
        assert any(str(n) in error["message"] for n in range(1200, 1240)), error["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_warns(real_server):
    prompt = "hello " * 1200
    response = post(real_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 100})
    assert response.status_code == 200, response.text
    assert response.headers["X-Warning"] == "prompt_truncated"
    assert response.json()["usage"]["prompt_tokens"] == 100
    short = post(real_server, "/generate", {"prompt": "Hello", "max_tokens": 1, "truncate_prompt_tokens": 100})
    assert short.status_code == 200 and "X-Warning" not in short.headers


def test_body_over_max_request_bytes_is_413(real_server):
    big = {"prompt": "x" * 70_000, "max_tokens": 1}  # --max-request-bytes 65536
    assert_openai_error(post(real_server, "/v1/completions", big), 413, "65536")

    def chunks():  # no Content-Length: the limit holds while reading the stream
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"x" * 1000
        yield b'"}'

    response = httpx.post(real_server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert_openai_error(response, 413)


def test_api_key_is_required_except_for_health_and_metrics(real_server):
    body = GENERATION_ENDPOINTS["/v1/completions"]
    missing = httpx.post(real_server.url + "/v1/completions", json=body, timeout=60)
    error = assert_openai_error(missing, 401)
    assert error["type"] == "authentication_error"
    wrong = httpx.post(real_server.url + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer nope"})
    assert_openai_error(wrong, 401)
    assert httpx.get(real_server.url + "/v1/models", timeout=60).status_code == 401
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(real_server.url + path, timeout=60).status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=real_server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_openai_client_sees_bad_requests(real_server):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"priority": 70000})


def test_unknown_routes_and_methods_are_openai_shaped(real_server):
    assert_openai_error(httpx.get(real_server.url + "/v1/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(real_server.url + "/v1/completions", headers=AUTH), 405)


def test_the_server_still_serves_after_all_that(real_server):
    response = post(real_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in real_server.stderr()
