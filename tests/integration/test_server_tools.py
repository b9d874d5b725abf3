"""Tool calling on the real server with the official client (the bundled model's template ignores tools: they reach
it as the Hermes system prompt): required and named calls, the follow-up turn with the tool's result, calls read
from free text (auto), streamed calls as OpenAI streams them, and bad tools answered 400."""
from __future__ import annotations

import json

import openai
import pytest

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# the exact Hermes call, forced by a regex so that tool_choice "auto" has a call to read back
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_required_call_is_returned_and_its_result_answers_the_next_turn(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                              max_tokens=64, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"}
    follow_up = ASK + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER, TIME], max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_a_named_call_has_that_function_and_arguments_of_its_schema(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_auto_reads_a_hermes_call_from_the_output_whole_and_streamed(client):
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0,
                   extra_body={"guided_regex": HERMES_CALL.replace("{", "\\{").replace("}", "\\}")})
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [d for c in chunks for ch in c.choices for d in (ch.delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    assert not any(ch.delta.content for c in chunks for ch in c.choices)


def test_tool_choice_none_answers_in_text(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                              max_tokens=8, temperature=0)
    assert response.choices[0].message.tool_calls is None and response.choices[0].message.content


@pytest.mark.parametrize("extra, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "not among"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, "drop the other one"),
])
def test_bad_tools_are_400(client, real_server, extra, words):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert words in error.value.body["message"]
    assert real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=MODEL) == 0
