"""Tool calls read from model text: Hermes and Llama 3 JSON, whole and piece by piece (every split of the text
gives the same events), the forced outputs of required and named tool_choice; and the requests' tools checked."""
from __future__ import annotations

import json

import pytest

from dflash2.server.bad_request import BadRequest
from dflash2.server.tool_parsers import ContentDelta, ToolCall, make_reader, parse_all
from dflash2.server.tools import ToolRequest, choose_parser, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def streamed(parser: str, text: str, piece: int) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `text` `piece` characters at a time; the text sent and the calls, in order."""
    reader = make_reader(parser)
    events = []
    for start in range(0, len(text), piece):
        events += reader.feed(text[start:start + piece])
    events += reader.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_calls_come_out_the_same_however_the_text_is_split(piece):
    content, calls = streamed("hermes", HERMES, piece)
    assert content == "Let me check.\n\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_text_without_calls_is_all_content_and_a_held_back_prefix_is_released():
    reader = make_reader("hermes")
    assert reader.feed("a < b and <tool") == [ContentDelta("a < b and ")]
    assert reader.finish() == [ContentDelta("<tool")]
    assert parse_all(make_reader("hermes"), "Just text.") == ("Just text.", [])


def test_hermes_an_unclosed_call_counts_if_its_json_is_whole_else_it_is_text():
    content, calls = parse_all(make_reader("hermes"), '<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    content, calls = parse_all(make_reader("hermes"), 'x <tool_call>{"name": "get_ti')
    assert content == 'x <tool_call>{"name": "get_ti' and calls == []
    content, calls = parse_all(make_reader("hermes"), "<tool_call>[1, 2]</tool_call>")
    assert content == "<tool_call>[1, 2]</tool_call>" and calls == []


def test_arguments_given_as_a_json_string_or_as_parameters_are_read_too():
    _, calls = parse_all(make_reader("hermes"),
                         '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                         '<tool_call>{"name": "g", "parameters": {"b": [2]}}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"b": [2]})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_llama3_json_calls_and_text(piece):
    text = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert streamed("llama3_json", text, piece) == ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])
    assert streamed("llama3_json", "The weather is fine.", piece) == ("The weather is fine.", [])
    assert streamed("llama3_json", '{"not": "a call"}', piece) == ('{"not": "a call"}', [])


def test_forced_outputs_of_required_and_named_choices():
    reader = make_reader("hermes", "named", "get_weather")
    assert reader.feed('{"city": "Rome"}') == []
    [call] = reader.finish()
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    content, calls = parse_all(make_reader("hermes", "required"),
                               '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                               '"parameters": {"city": "Lima"}}]')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_all(make_reader("hermes", "required"), '[{"name": "get_ti') == ('[{"name": "get_ti', [])


def test_tool_request_checks_tools_and_choice_and_forces_output():
    assert ToolRequest.of(None, None, None) is None
    assert ToolRequest.of([WEATHER], "none", None) is None
    auto = ToolRequest.of([WEATHER, TIME], None, None)
    assert auto.choice == "auto" and auto.forced_output() is None
    named = ToolRequest.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.forced_output().json == WEATHER["function"]["parameters"]
    required = ToolRequest.of([WEATHER, TIME], "required", False).forced_output().json
    assert required["minItems"] == 1 and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    for tools, choice, words in (([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
                                 ([WEATHER], "sometimes", "tool_choice' must be"),
                                 (None, "required", "needs 'tools'"),
                                 ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "letters"),
                                 ([{"type": "retrieval"}], "auto", "tools\\[0\\]. must be"),
                                 ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                                  "required", "cannot be enforced")):
        with pytest.raises(BadRequest, match=words):
            ToolRequest.of(tools, choice, None).forced_output()


def test_templates_that_read_tools_get_them_and_others_get_the_hermes_rendering():
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_2"}]
    messages, tools = template_messages(conversation, [WEATHER], "{% for tool in tools %}{% endfor %}")
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == conversation[2]
    messages, tools = template_messages(conversation, [WEATHER], "{{ messages }}")
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
                                     "</tool_call>"
    assert messages[3]["content"] == "<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n" \
                                     "</tool_response>"
    assert choose_parser("auto", "{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert choose_parser("auto", "{{ '<tool_call>' }}") == choose_parser("auto", None) == "hermes"
    assert choose_parser("llama3_json", None) == "llama3_json"
