"""Request bodies: strict types, OpenAI defaults, vLLM extras and priority mapped onto SamplingParams."""
from __future__ import annotations

import pytest

from dflash2.server.json_body import decode_json
from dflash2.structured_outputs import StructuredOutputsParams
from dflash2.server.body import parse_body
from dflash2.server.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                     RequestLimits)

LIMITS = RequestLimits(vocab_size=1000, max_logprobs=20, max_prompts_per_request=4)
CHAT = [{"role": "user", "content": "x"}]


def test_completion_defaults_and_extras():
    body = parse_body(CompletionRequest, {"prompt": "Hi", "top_k": 5, "min_tokens": 2, "ignore_eos": True,
                                          "stop_token_ids": [7], "repetition_penalty": 1.2, "seed": 3,
                                          "priority": 1000, "unknown_field": 1})
    params = body.sampling_params(body.max_tokens, body.logprobs, LIMITS)
    assert body.max_tokens == 16 and body.priority == 1000
    assert (params.top_k, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (5, 2, True, [7])
    assert (params.repetition_penalty, params.seed, params.temperature) == (1.2, 3, 1.0)
    assert body.prompts(LIMITS) == ["Hi"]
    assert parse_body(CompletionRequest, {"prompt": [1, 2]}).prompts(LIMITS) == [[1, 2]]
    assert parse_body(CompletionRequest, {"prompt": ["a", "b"]}).prompts(LIMITS) == ["a", "b"]


@pytest.mark.parametrize("data, words", [
    ({"prompt": 1}, "'prompt' has the wrong type"),
    ({}, "'prompt' is required"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be in \\[1, "),
    ({"prompt": "x", "priority": 65536}, "priority"),
    ({"prompt": "x", "priority": -1}, "priority"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "best_of": 2, "n": 3}, "best_of must be in \\[n, "),
    ({"prompt": "x", "n": 17}, "n must be at most 16"),
    ({"prompt": "x", "best_of": 17}, "best_of must be at most 16"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of > n"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias values must be in \\[-100, 100\\]"),
    ({"prompt": "x", "logit_bias": {"5": -100.5}}, "logit_bias values"),
    ({"prompt": "x", "logit_bias": {"1000": 1}}, "logit_bias keys must be token ids in \\[0, 1000\\)"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias keys must be token ids, got 'a'"),
    ({"prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_completion_bodies(data, words):
    with pytest.raises(BadRequest, match=words):
        body = parse_body(CompletionRequest, data)
        body.sampling_params(body.max_tokens, body.logprobs, LIMITS)


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
        body = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                  "response_format": {"type": "json_objekt"}})
        body.sampling_params(None, None, LIMITS)


def test_n_best_of_and_logit_bias_reach_the_sampling_params():
    body = parse_body(CompletionRequest, {"prompt": "x", "n": 2, "best_of": 4, "logit_bias": {"7": -100, "9": 2.5}})
    params = body.sampling_params(body.max_tokens, body.logprobs, LIMITS)
    assert (params.n, params.best_of, params.logit_bias) == (2, 4, {7: -100, 9: 2.5})
    body = parse_body(ChatCompletionRequest, {"messages": CHAT, "n": 3, "stream": True})
    assert body.sampling_params(body.requested_max_tokens, body.num_logprobs, LIMITS).n == 3
    for field in ("n", "best_of"):
        with pytest.raises(BadRequest, match=f"/generate returns one sample: {field} must be 1"):
            parse_body(GenerateRequest, {"prompt": "x", field: 2})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": '{"type": "string"}'}, StructuredOutputsParams(json='{"type": "string"}')),
    ({"guided_regex": "[ab]+"}, StructuredOutputsParams(regex="[ab]+")),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"},
     StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": False}},
     StructuredOutputsParams(choice=["a", "b"])),
])
def test_structured_output_fields_map_onto_the_sampling_params(fields, expected):
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": CHAT})):
        body = parse_body(model, {**base, **fields})
        assert body.sampling_params(16, None, LIMITS).structured_outputs == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": {"type": "objekt"}}, "guided_json", "invalid JSON schema: Unsupported type \"objekt\""),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 5}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema needs"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid regex: .*parenthesis is not closed"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "invalid grammar: .*Rule \"foo\" is not defined"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output at a time"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "no field 'jsn'"),
])
def test_bad_structured_output_is_400_naming_the_field(fields, param, words):
    with pytest.raises(BadRequest, match=words) as error:
        body = parse_body(CompletionRequest, {"prompt": "x", **fields})
        body.sampling_params(16, None, LIMITS)
    assert error.value.param == param


def test_generate_needs_exactly_one_prompt_form():
    assert parse_body(GenerateRequest, {"prompt_token_ids": [1, 2]}).prompt_token_ids == [1, 2]
    for data in ({}, {"prompt": "a", "prompt_token_ids": [1]}):
        with pytest.raises(BadRequest, match="exactly one"):
            parse_body(GenerateRequest, data)
    with pytest.raises(BadRequest, match="JSON object"):
        parse_body(GenerateRequest, ["prompt"])


# -- issue 40: fields of OpenAI or vLLM that are not honoured are refused, never ignored ----------------
@pytest.mark.parametrize("field, value", [
    ("guided_whitespace_pattern", " "), ("guided_decoding_backend", "outlines"), ("use_beam_search", True),
    ("length_penalty", 0.5), ("allowed_token_ids", [1]),
    ("bad_words", ["x"]), ("logits_processors", ["f"]), ("response_format", {"type": "structural_tag"}),
    ("spaces_between_special_tokens", False), ("return_tokens_as_token_ids", True), ("cache_salt", "s"),
    ("vllm_xargs", {"a": 1}), ("prompt_embeds", "AAAA"),
])
def test_completion_fields_not_honoured_are_400_naming_them(field, value):
    with pytest.raises(BadRequest) as error:
        body = parse_body(CompletionRequest, {"prompt": "x", field: value})
        body.sampling_params(body.max_tokens, body.logprobs, LIMITS)
    assert error.value.param == field and field in str(error.value)


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("audio", {"voice": "x"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {"search_context_size": "low"}), ("reasoning_effort", "high"), ("verbosity", "low"),
    ("store", True), ("service_tier", "flex"), ("echo", True), ("documents", [{"text": "d"}]),
    ("chat_template", "{{ messages }}"), ("use_beam_search", True),
])
def test_chat_fields_not_honoured_are_400_naming_them(field, value):
    with pytest.raises(BadRequest) as error:
        body = parse_body(ChatCompletionRequest, {"messages": CHAT, field: value})
        body.sampling_params(body.requested_max_tokens, body.num_logprobs, LIMITS)
    assert error.value.param == field and field in str(error.value)


def test_harmless_values_of_those_fields_and_accepted_fields_pass():
    harmless = {"use_beam_search": False, "best_of": 1, "length_penalty": 1.0, "tool_choice": "none", "tools": [],
                "logit_bias": {}, "response_format": {"type": "text"}, "store": False, "service_tier": "auto",
                "modalities": ["text"], "spaces_between_special_tokens": True, "user": "u", "metadata": {"k": "v"},
                "prompt_cache_key": "k", "parallel_tool_calls": True, "safety_identifier": "s",
                "stream_options": {"include_usage": True, "include_obfuscation": True}, "stream": True}
    body = parse_body(ChatCompletionRequest, {"messages": CHAT, **harmless})
    body.sampling_params(body.requested_max_tokens, body.num_logprobs, LIMITS)


def test_unknown_fields_pass_and_are_logged_once(caplog):
    for _ in range(3):
        parse_body(CompletionRequest, {"prompt": "x", "a_field_of_no_api": 1})
    assert sum("a_field_of_no_api" in r.getMessage() for r in caplog.records) == 1


def test_integer_fields_take_integral_floats_as_openai_does():
    body = parse_body(CompletionRequest, {"prompt": [1.0, 2], "max_tokens": 5.0, "seed": 3.0, "priority": 7.0,
                                          "logprobs": 2.0})
    assert (body.max_tokens, body.seed, body.priority, body.logprobs, body.prompt) == (5, 3, 7, 2, [1, 2])
    for field in ("max_tokens", "seed", "priority", "logprobs", "top_k", "n"):
        with pytest.raises(BadRequest, match=field):
            parse_body(CompletionRequest, {"prompt": "x", field: 1.5})
    with pytest.raises(BadRequest, match="max_tokens"):
        parse_body(CompletionRequest, {"prompt": "x", "max_tokens": True})


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 1001), ("top_k", -2), ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
    ("temperature", 1e300), ("top_p", 1.5), ("min_p", -0.1), ("presence_penalty", 3.0),
    ("frequency_penalty", -1e308), ("seed", 2**64), ("seed", -(2**63) - 1), ("max_tokens", 2**31),
    ("min_tokens", 2**40), ("logprobs", 21), ("logprobs", 10**6), ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("stop_token_ids", [1000]), ("stop_token_ids", [2**70]),
])
def test_every_sampling_parameter_is_range_checked_naming_it(field, value):
    with pytest.raises(BadRequest) as error:
        body = parse_body(CompletionRequest, {"prompt": "x", field: value})
        body.sampling_params(body.max_tokens, body.logprobs, LIMITS)
    assert error.value.param == field, str(error.value)


def test_chat_top_logprobs_are_bounded_by_max_logprobs():
    body = parse_body(ChatCompletionRequest, {"messages": CHAT, "logprobs": True, "top_logprobs": 21})
    with pytest.raises(BadRequest, match="top_logprobs must be in \\[0, 20\\]") as error:
        body.sampling_params(body.requested_max_tokens, body.num_logprobs, LIMITS)
    assert error.value.param == "top_logprobs"
    body = parse_body(ChatCompletionRequest, {"messages": CHAT, "logprobs": True, "top_logprobs": 20.0})
    assert body.sampling_params(None, body.num_logprobs, LIMITS).logprobs == 20


def test_prompt_logprobs_reach_sampling_params_and_echo_asks_for_them():
    body = parse_body(CompletionRequest, {"prompt": "x", "prompt_logprobs": 3})
    assert body.sampling_params(body.max_tokens, body.logprobs, LIMITS).prompt_logprobs == 3
    body = parse_body(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 2})
    assert body.sampling_params(body.max_tokens, body.logprobs, LIMITS).prompt_logprobs == 2
    with pytest.raises(BadRequest, match="prompt_logprobs"):
        parse_body(CompletionRequest, {"prompt": "x", "prompt_logprobs": 1, "stream": True})


def test_prompts_per_request_are_capped():
    assert len(parse_body(CompletionRequest, {"prompt": ["a"] * 4}).prompts(LIMITS)) == 4
    with pytest.raises(BadRequest, match="at most 4") as error:
        parse_body(CompletionRequest, {"prompt": [[1]] * 5}).prompts(LIMITS)
    assert error.value.param == "prompt"


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "\\ud800"}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "surrogate"),
    (b'{"prompt": "x", "\\ud800": 1}', "surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"prompt": "x", "stop": ' + b"[" * 70 + b"]" * 70 + b"}", "nests deeper"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": -Infinity}', "Infinity"),
    (b'{"prompt": "\xff"}', "UTF-8"),
    (b'{"prompt": ', "not valid JSON"),
])
def test_malformed_bodies_are_bad_requests(raw, words):
    with pytest.raises(BadRequest, match=words):
        decode_json(raw)


def test_paired_surrogates_and_numbers_that_overflow_floats():
    assert decode_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    with pytest.raises(BadRequest, match="temperature"):  # 1e999 decodes to inf: not a finite number
        parse_body(CompletionRequest, decode_json(b'{"prompt": "x", "temperature": 1e999}'))


@pytest.mark.parametrize("raw, value", [(b"-1", -1), (b'"x"', "x"), (b"null", None), (b"[1, [2]]", [1, [2]])])
def test_bodies_that_are_not_objects_decode_for_parse_body_to_refuse(raw, value):
    assert decode_json(raw) == value
    with pytest.raises(BadRequest, match="JSON object"):
        parse_body(CompletionRequest, value)


@pytest.mark.parametrize("field, value, words", [
    ("tool_calls", [{"id": "c", "type": "function"}], "tool_calls must each be"),
    ("audio", {"id": "a"}, "audio"), ("function_call", {"name": "f", "arguments": "{}"}, "function_call")])
def test_messages_with_malformed_tool_calls_or_audio_are_refused_not_rendered_without_them(field, value, words):
    body = parse_body(ChatCompletionRequest, {"messages": [{"role": "assistant", "content": "x", field: value}]})
    with pytest.raises(BadRequest, match=words):
        body.messages[0].as_template_input()


def test_messages_with_tool_calls_and_tool_results_reach_the_template():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = parse_body(ChatCompletionRequest, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c"}]})
    assert [m.as_template_input() for m in body.messages] == [
        {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "42",
                                                                    "tool_call_id": "c"}]
