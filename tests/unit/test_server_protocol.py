"""Request bodies: strict types, OpenAI defaults, vLLM extras and priority mapped onto SamplingParams."""
from __future__ import annotations

import pytest

from dflash2.server.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                     parse_body)


def test_completion_defaults_and_extras():
    body = parse_body(CompletionRequest, {"prompt": "Hi", "top_k": 5, "min_tokens": 2, "ignore_eos": True,
                                          "stop_token_ids": [7], "repetition_penalty": 1.2, "seed": 3,
                                          "priority": 1000, "unknown_field": 1})
    params = body.sampling_params(body.max_tokens, body.logprobs)
    assert body.max_tokens == 16 and body.priority == 1000
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (5, 2, True, [7])
    assert (params.repetition_penalty, params.seed, params.temperature) == (1.2, 3, 1.0)
    assert body.prompts() == ["Hi"]
    assert parse_body(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_body(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]


@pytest.mark.parametrize("data, words", [
    ({"prompt": 1}, "'prompt' has the wrong type"),
    ({}, "'prompt' is required"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be >= 1"),
    ({"prompt": "x", "priority": 65536}, "priority"),
    ({"prompt": "x", "priority": -1}, "priority"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_completion_bodies(data, words):
    with pytest.raises(BadRequest, match=words):
        body = parse_body(CompletionRequest, data)
        body.sampling_params(body.max_tokens, body.logprobs)


def test_chat_max_completion_tokens_logprobs_and_content_parts():
    body = parse_body(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 9, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert body.requested_max_tokens == 9 and body.num_logprobs == 2
    assert body.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    assert parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}).requested_max_tokens \
        is None  # chat: up to the context
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}
    with pytest.raises(BadRequest, match="text content"):
        parse_body(ChatCompletionRequest, image).messages[0].as_template_input()
    with pytest.raises(BadRequest, match="response_format"):
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                           "response_format": {"type": "json_object"}})


def test_generate_needs_exactly_one_prompt_form():
    assert parse_body(GenerateRequest, {"prompt_token_ids": [1, 2]}).prompt_token_ids == [1, 2]
    for data in ({}, {"prompt": "a", "prompt_token_ids": [1]}):
        with pytest.raises(BadRequest, match="exactly one"):
            parse_body(GenerateRequest, data)
    with pytest.raises(BadRequest, match="JSON object"):
        parse_body(GenerateRequest, ["prompt"])
