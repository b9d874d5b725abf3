"""A second real server with the streaming timeout, token logs, a metrics port, a served model name, one torch
thread for its engine, a chat template of its own and --max-n 2.

--streaming-timeout-ms 1 ends every stream before its first token (a forward pass takes far longer than
1 ms), so the timeout path runs for certain; requests that do not stream are not affected.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow

NAME = "tiny"
# reads `tools` and writes each message's calls: the server passes both as they are (arguments as objects)
TEMPLATE = """{%- if tools %}<|im_start|>system
TOOLS:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message.role }} (own template)
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>\
{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def flagged_server(tmp_path_factory):
    metrics_port = free_port()
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess("--max-model-len", "512", "--streaming_timeout_ms", "1", "--log_tokens",
                           "--metrics_port", str(metrics_port), "--disable_log_requests", "--served_model_name", NAME,
                           "--max_num_seqs", "4", "--num_threads", "1", "--chat-template", str(template),
                           "--max-n", "2")
    server.metrics_port = metrics_port
    server.start()
    yield server
    server.cleanup()


def test_stream_without_a_token_in_time_ends_with_an_error_and_frees_pages(flagged_server):
    timeouts_before = flagged_server.metric("dflash2_streaming_timeout_total", model_name=NAME)
    body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", flagged_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "no token for 1 ms" in error["message"] and error["type"] == "timeout_error"
    assert flagged_server.wait_for_metric("dflash2_streaming_timeout_total",
                                          lambda v: v == timeouts_before + 1, model_name=NAME) == timeouts_before + 1
    assert flagged_server.wait_for_metric("dflash2_request_success_total", lambda v: v >= 1, model_name=NAME,
                                          finished_reason="abort") >= 1
    assert flagged_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=NAME) == 0
    assert flagged_server.metric("dflash2_streaming_success_total", model_name=NAME) == 0


def test_openai_client_raises_on_a_timed_out_stream(flagged_server):
    client = openai.OpenAI(base_url=flagged_server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIError, match="no token"):
        for _ in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=50, stream=True):
            pass


def test_non_streamed_requests_log_one_json_line_per_token(flagged_server):
    response = httpx.post(flagged_server.url + "/generate", timeout=60, json={
        "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True, "priority": 42})
    assert response.status_code == 200
    request_id = response.json()["id"]
    tokens = [r for r in flagged_server.json_logs() if r.get("req_id") == request_id]
    assert [r["token_id"] for r in tokens] == response.json()["token_ids"]
    for record in tokens:
        assert set(record) >= {"req_id", "token_id", "token_text", "latency_ms", "kv_cache_size_bytes", "priority",
                               "model"}
        assert record["priority"] == 42 and record["model"] == NAME and record["kv_cache_size_bytes"] > 0
    assert "".join(r["token_text"] for r in tokens) == response.json()["text"]
    assert not [r for r in flagged_server.json_logs() if r.get("event") == "request_finished"]


def test_metrics_port_and_served_model_name(flagged_server):
    on_port = httpx.get(f"http://127.0.0.1:{flagged_server.metrics_port}/metrics", timeout=10).text
    assert f'dflash2_num_requests_running{{model_name="{NAME}"}}' in on_port
    models = httpx.get(flagged_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [NAME]
    for model in (NAME, "SmolLM2-135M-Instruct"):
        response = httpx.post(flagged_server.url + "/v1/completions", timeout=60,
                              json={"model": model, "prompt": "Hi", "max_tokens": 1})
        assert response.status_code == 200 and response.json()["model"] == NAME


def test_num_threads_sets_the_engine_process_threads(flagged_server):
    assert flagged_server.metric("dflash2_engine_torch_threads") == 1
    assert "engine: torch threads 1 (--num-threads;" in flagged_server.stderr()


def test_the_chat_template_flag_replaces_the_models_and_receives_tools(flagged_server):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    tokens = httpx.post(flagged_server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    text = httpx.post(flagged_server.url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert "<|im_start|>user (own template)\nWeather in Oslo?" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool (own template)\ncold" in text
    client = openai.OpenAI(base_url=flagged_server.url + "/v1", api_key="none", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}
    plain = client.chat.completions.create(model=NAME, messages=messages[:1], max_tokens=1)
    response = client.chat.completions.create(model=NAME, messages=messages[:1], tools=[tool], max_tokens=32,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert response.usage.prompt_tokens > plain.usage.prompt_tokens  # the TOOLS line
    assert json.loads(response.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Rome")


def test_max_n_bounds_n_and_best_of(flagged_server):
    client = openai.OpenAI(base_url=flagged_server.url + "/v1", api_key="none", max_retries=0)
    assert len(client.completions.create(model=NAME, prompt="Hi", max_tokens=2, n=2).choices) == 2
    for extra in ({"n": 3}, {"best_of": 3}):
        with pytest.raises(openai.BadRequestError, match="at most 2 \\(the server's --max-n\\)"):
            client.completions.create(model=NAME, prompt="Hi", max_tokens=2, extra_body=extra)
