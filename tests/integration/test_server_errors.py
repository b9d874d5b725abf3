"""Bad input to the real server: OpenAI-style 400s, 413, 401; never a 500 and never a crash."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

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
    ("top_p", 0.0, ("top_p",)),
    ("stop_token_ids", [10 ** 9], ("stop_token_ids",)),
    ("top_k", 2 ** 63, ("top_k",)),  # broke the engine step and every request beside it
    ("top_k", 49153, ("top_k", "vocabulary")),
    ("repetition_penalty", 1e-300, ("repetition_penalty",)),  # answered token 0 over and over
    ("temperature", 1e300, ("temperature",)),
    ("seed", 2 ** 64, ("seed",)),
    ("max_tokens", 1.5, ("max_tokens",)),
    ("guided_choice", [], ("guided_choice", "non-empty")),
    ("guided_json", {"type": "objekt"}, ("guided_json", "invalid JSON schema", "objekt")),
    ("guided_regex", "(yes|no", ("guided_regex", "invalid regex")),
    ("guided_grammar", "root ::= yes", ("guided_grammar", "invalid grammar")),
    ("structured_outputs", {"choice": ["yes"], "regex": "a"}, ("structured_outputs", "exactly one")),
    ("use_beam_search", True, ("use_beam_search",)),
    ("response_format", {"type": "json_schema"}, ("response_format", "json_schema needs")),
    ("prompt_logprobs", 21, ("prompt_logprobs", "20")),
])
def test_bad_fields_are_400(real_server, path, field, value, words):
    error = assert_openai_error(post(real_server, path, {**GENERATION_ENDPOINTS[path], field: value}), 400, *words)
    assert error["param"] == field


@pytest.mark.parametrize("path", list(GENERATION_ENDPOINTS))
def test_an_unknown_model_is_404_model_not_found(real_server, path):
    error = assert_openai_error(post(real_server, path, {**GENERATION_ENDPOINTS[path], "model": "gpt-4"}), 404,
                                "gpt-4", "does not exist")
    assert (error["code"], error["type"], error["param"]) == ("model_not_found", "invalid_request_error", "model")


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "logprobs", 21), ("/generate", "logprobs", 8000),
    ("/v1/chat/completions", "top_logprobs", 21),
])
def test_logprobs_past_max_logprobs_are_400(real_server, path, field, value):
    body = {**GENERATION_ENDPOINTS[path], field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_openai_error(post(real_server, path, body), 400, field, "20")
    ok = post(real_server, path, {**body, field: 20})
    assert ok.status_code == 200, ok.text


def test_integral_floats_are_integers_as_in_openai(real_server):
    response = post(real_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2.0, "seed": 7.0, "n": 1.0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2


def test_more_prompts_than_max_prompts_per_request_is_400(real_server):
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": ["Hi"] * 65, "max_tokens": 1}), 400,
                        "65 prompts", "64")
    response = post(real_server, "/v1/completions", {"prompt": [[1, 2]] * 8, "max_tokens": 1})
    assert response.status_code == 200 and len(response.json()["choices"]) == 8


def test_unknown_fields_pass_and_the_log_names_each_once(real_server):
    for _ in range(2):
        response = post(real_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "x_unknown_field_40": 1})
        assert response.status_code == 200
    assert real_server.stderr().count("'x_unknown_field_40'") == 1


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
    assert_openai_error(post(real_server, "/v1/completions", {"prompt": "Hi", "use_beam_search": True}), 400,
                        "beam search")
    functions = [{"name": "f"}]  # the legacy function calling (tools are honoured)
    assert_openai_error(post(real_server, "/v1/chat/completions",
                             {**GENERATION_ENDPOINTS["/v1/chat/completions"], "functions": functions}), 400,
                        "functions", "use tools")


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
    assert missing.headers["WWW-Authenticate"] == "Bearer"
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
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"priority": 70000})


MALFORMED = {
    "a lone surrogate in a prompt": ("/v1/completions", b'{"prompt": "Hi \\ud800", "max_tokens": 1}'),
    "a lone surrogate in chat content": ("/v1/chat/completions",
                                         b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'),
    "a lone surrogate in /tokenize": ("/tokenize", b'{"prompt": "\\ud83d"}'),
    "JSON nested 30,000 deep": ("/v1/completions", b'{"prompt": "Hi", "stop": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"),
    "an integer of 5,000 digits": ("/generate", b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    "NaN": ("/v1/completions", b'{"prompt": "Hi", "temperature": NaN}'),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_is_400_and_keeps_the_connection(real_server, case):
    """Each was a 500 whose connection the server then closed: a client's next keep-alive request was reset."""
    path, raw = MALFORMED[case]
    address = urlsplit(real_server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        connection.request("POST", path, body=raw, headers=headers)
        bad = connection.getresponse()
        error = json.loads(bad.read())["error"]
        assert bad.status == 400 and set(error) == {"message", "type", "param", "code"}, error
        assert "Traceback" not in error["message"] and "Error:" not in error["message"]
        socket = connection.sock
        assert socket is not None  # (http.client drops its socket when the answer says Connection: close)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hello", "max_tokens": 1}),
                           headers=headers)
        good = connection.getresponse()
        assert good.status == 200, good.read()
        good.read()
        assert connection.sock is socket  # the same keep-alive connection
    finally:
        connection.close()


def test_openapi_document_is_served_without_the_key(real_server):
    document = httpx.get(real_server.url + "/openapi.json", timeout=60).json()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "top_logprobs", "prompt_logprobs", "priority", "guided_json", "tools"} <= set(fields)


def test_unknown_routes_and_methods_are_openai_shaped(real_server):
    assert_openai_error(httpx.get(real_server.url + "/v1/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(real_server.url + "/v1/completions", headers=AUTH), 405)


def test_the_server_still_serves_after_all_that(real_server):
    response = post(real_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in real_server.stderr()
