"""Structured output on the real server with the official client: a pydantic model parsed back by
`chat.completions.parse`, JSON schemas on both routes, guided_choice, streaming, and bad constraints answered 400
with the server serving on and no page held."""
from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int
    coastal: bool


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_chat_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Lisbon as JSON."}], response_format=City,
        max_tokens=64, temperature=0)
    message = completion.choices[0].message
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content) == message.parsed
    assert completion.choices[0].finish_reason == "stop"


def test_json_schema_and_json_object_on_the_completions_route(client):
    schema = City.model_json_schema()
    response = client.completions.create(model=MODEL, prompt="A city as JSON:", max_tokens=64, temperature=0,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": "city", "schema": schema}}})
    City.model_validate_json(response.choices[0].text)
    response = client.completions.create(model=MODEL, prompt="A fruit as JSON:", max_tokens=64, temperature=0,
                                         extra_body={"guided_json": schema})
    City.model_validate_json(response.choices[0].text)
    response = client.chat.completions.create(
        model=MODEL, max_tokens=128, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a city as JSON with its name and population."}])
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_guided_choice_returns_one_of_the_choices_streamed_or_not(client):
    choices = ["sunny", "rainy", "cloudy"]
    messages = [{"role": "user", "content": "What is the weather like in Lisbon in July?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=3,
                                              n=4, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in response.choices)
    stream = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"guided_choice": choices})
    assert "".join(c.choices[0].text for c in stream if c.choices) in choices


def test_guided_regex_and_grammar(client):
    response = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=16, temperature=0,
                                         extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", response.choices[0].text)
    response = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=16, temperature=0,
                                         extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert response.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "invalid JSON schema: Unsupported type \"objekt\""),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}, "guided_json",
     "invalid JSON schema"),
    ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output at a time"),
])
def test_a_bad_constraint_is_400_naming_it_and_the_server_serves_on(client, real_server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert words in error.value.body["message"] and error.value.body["param"] == param
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yes or no?"}],
                                              max_tokens=4, extra_body={"guided_choice": ["yes", "no"]})
    assert response.choices[0].message.content in ("yes", "no")
    assert real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=MODEL) == 0
