"""Tool calling in chat completions: the request's tools and tool_choice, how they reach the prompt, and which
output they force.

    tools + tool_choice ──► ToolRequest.of(body)            (400 for a malformed tool or choice)
        "none"      tools left out of the prompt; the answer is text
        "auto"      tools in the prompt; tool calls read from the output (tool_parsers.py)
        "required"  the output is forced (structured output) to a JSON list of calls of the given tools
        {"type": "function", "function": {"name": f}}
                    the output is forced to f's arguments (its parameters schema); the call is built around it

The prompt: the chat template gets `tools=` (apply_chat_template), assistant messages with `tool_calls` (their
arguments as objects, as templates expect) and `tool` messages. A template that never reads `tools` (SmolLM2's,
for one) would drop them silently: the tools then go into the system message in the Hermes format, earlier calls
into the assistant's text and tool results into user turns, which the hermes parser reads back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dflash2.server.bad_request import BadRequest
from dflash2.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # {"type": "function", "function": {...}}, checked
    choice: str  # "auto", "required" or "named"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @classmethod
    def of(cls, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
        """The request's tool calling; None when it asks for none (no tools, or tool_choice "none")."""
        if tool_choice == "none" or (not tools and tool_choice in (None, "auto")):
            return None
        if not tools:
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
        checked = [_check_tool(tool, index) for index, tool in enumerate(tools)]
        names = [tool["function"]["name"] for tool in checked]
        if tool_choice in (None, "auto", "required"):
            return cls(checked, tool_choice or "auto", parallel=parallel_tool_calls is not False)
        named = _named_choice(tool_choice)
        if named not in names:
            raise BadRequest(f"'tool_choice' names the function {named!r}, which is not among the tools "
                             f"({', '.join(names)})", param="tool_choice")
        return cls(checked, "named", named, parallel=False)

    def forced_output(self) -> StructuredOutputsParams | None:
        """The structured output a required or named choice forces (None for auto); 400 if a tool's parameters
        are not a schema that compiles."""
        if self.choice == "auto":
            return None
        by_name = {tool["function"]["name"]: tool["function"].get("parameters") or _ANY_OBJECT for tool in self.tools}
        if self.choice == "named":
            forced = StructuredOutputsParams(json=by_name[self.named])
        else:
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": schema},
                      "required": ["name", "parameters"]} for name, schema in by_name.items()]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            forced = StructuredOutputsParams(json=array)
        try:
            forced.check()
        except ValueError as e:
            raise BadRequest(f"'tools': a function's parameters cannot be enforced: {e}", param="tools") from None
        return forced


def _check_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise BadRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}",
                         param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"'{where}.function.parameters' must be a JSON schema object", param="tools")
    if not isinstance(function.get("description", ""), str):
        raise BadRequest(f"'{where}.function.description' must be a string", param="tools")
    return {"type": "function", "function": function}


def _named_choice(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        return tool_choice["function"]["name"]
    raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}", param="tool_choice")


def check_message_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, each {"id", "type": "function", "function": {"name", "arguments"}}."""
    for call in calls:
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), (str, dict)):
            raise BadRequest("a message's tool_calls must each be {\"id\", \"type\": \"function\", \"function\": "
                             "{\"name\", \"arguments\"}}", param="messages")
    return calls


def choose_parser(configured: str, template: str | None) -> str:
    """The tool-call parser: the one configured (--tool-call-parser), or by what the chat template writes."""
    if configured != "auto":
        return configured
    if template and "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def template_reads_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


# -- the conversation as the template takes it -------------------------------------------------------------
def template_messages(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template: arguments as objects for templates that read tools; for one
    that does not, the Hermes rendering described in the module docstring (and no `tools=`)."""
    messages = [_arguments_as_objects(message) for message in conversation]
    if template_reads_tools(template):
        return messages, tools
    rendered = _hermes_messages(messages)
    return (_with_tool_prompt(rendered, tools) if tools else rendered), None


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # kept as the client sent it
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _hermes_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls as <tool_call> text in the assistant's turn; tool results as <tool_response> text in a user
    turn, consecutive ones in one (templates that alternate roles refuse two user turns in a row)."""
    rendered: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        if message["role"] != "tool":
            rendered.append(_calls_as_text(message))
            previous_was_tool = False
            continue
        response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
        if previous_was_tool:
            rendered[-1] = {**rendered[-1], "content": rendered[-1]["content"] + "\n" + response}
        else:
            rendered.append({"role": "user", "content": response})
        previous_was_tool = True
    return rendered


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [json.dumps({"name": call["function"].get("name"), "arguments": call["function"].get("arguments")},
                         ensure_ascii=False) for call in calls]
    text = "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
    content = f"{message['content']}\n{text}" if message.get("content") else text
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": content}


def _with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = ("You can call functions to answer. These are the functions, one JSON object each, between <tools> "
              f"and </tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, answer with a JSON object naming "
              "it and giving its arguments, between <tool_call> and </tool_call>:\n<tool_call>\n"
              '{"name": "function name", "arguments": {"argument": "value"}}\n</tool_call>')
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{prompt}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
