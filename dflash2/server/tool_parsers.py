"""Tool calls in a model's text, read as it streams: Hermes style and Llama 3's JSON style.

    hermes       (Qwen, SmolLM, Hermes, and the tool prompt tools.py writes for templates without tools)
                 some text <tool_call>{"name": "f", "arguments": {...}}</tool_call> <tool_call>...</tool_call>
    llama3_json  {"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}
                 (the whole output; `<|python_tag|>` before it is a special token, already out of the text)

For a required or named tool_choice the output was forced into JSON (tools.py): ForcedCallsReader reads it.

A parser takes the text piece by piece (`feed`) and says what can be sent so far: ContentDelta for text that is
surely not part of a call (a possible start of `<tool_call>` at the end is held back), ToolCall once a call is
complete. `finish()` at the end sends what is left: an unclosed call whose JSON is whole counts as a call (a
model may stop right after its JSON); anything that does not parse goes out as text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Event = ContentDelta | ToolCall


def call_from_json(text: str) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> ToolCall; None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""  # text not yet sent: a possible start tag, or an open call's body
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    return events
                events.append(self._close(self._buffer[:end], self.START + self._buffer[:end] + self.END))
                self._buffer = self._buffer[end + len(self.END):]
                self._in_call = False
                continue
            start = self._buffer.find(self.START)
            if start < 0:
                keep = _partial_suffix(self._buffer, self.START)
                sendable = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(sendable):]
                _append_text(events, sendable)
                return events
            _append_text(events, self._buffer[:start])
            self._buffer = self._buffer[start + len(self.START):]
            self._in_call = True

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return [ContentDelta(rest)] if rest else []
        self._in_call = False
        return [self._close(rest, self.START + rest)]

    def _close(self, body: str, original: str) -> Event:
        call = call_from_json(body.strip())
        if call is None:
            return ContentDelta(original)
        self.calls.append(call)
        return call


class Llama3JsonParser:
    """The output is tool calls if it starts with '{' (after whitespace): then it is held to the end and read as
    JSON objects separated by ';'; else it is text as it comes."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided (only whitespace so far), "text" or "calls"
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._mode is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._mode = "calls" if stripped.startswith("{") else "text"
        if self._mode == "calls":
            return []
        text, self._buffer = self._buffer, ""
        return [ContentDelta(text)]

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return [ContentDelta(rest)] if rest else []
        calls = [call_from_json(part) for part in _json_objects(rest)]
        if not calls or any(call is None for call in calls):
            return [ContentDelta(rest)]
        self.calls.extend(calls)
        return list(calls)


class ForcedCallsReader:
    """The output a required or named tool_choice forced (tools.py): read whole at the end. Named: the text is the
    function's arguments. Required: a JSON list of {"name", "parameters"}. Text that does not parse (cut by
    max_tokens) goes out as text."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self._text = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return []

    def finish(self) -> list[Event]:
        text, self._text = self._text, ""
        if self.named is not None:
            call = call_from_json(json.dumps({"name": self.named, "arguments": text})) if _is_json(text) else None
            calls = [call] if call is not None else []
        else:
            items = json.loads(text) if _is_json(text) else None
            calls = [call_from_json(json.dumps(item)) for item in items] if isinstance(items, list) and items else []
        if not calls or any(call is None for call in calls):
            return [ContentDelta(text)] if text else []
        self.calls.extend(calls)
        return list(calls)


def make_reader(parser: str, choice: str = "auto", named: str | None = None) -> Any:
    """What reads one output's tool calls: the model's parser for tool_choice auto, else the forced output's."""
    if choice != "auto":
        return ForcedCallsReader(named)
    if parser == "hermes":
        return HermesParser()
    if parser == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(PARSERS)}")


def parse_all(reader: Any, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output's text around its calls (None if only whitespace) and its calls, read by `reader`."""
    events = reader.feed(text) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return (content if content.strip() else None), reader.calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _json_objects(text: str) -> list[str]:
    """The JSON values in `text`, separated by ';' or whitespace (a string may hold ';')."""
    decoder, parts, position = json.JSONDecoder(), [], 0
    text = text.strip()
    while position < len(text):
        try:
            _, end = decoder.raw_decode(text, position)
        except ValueError:
            return [text]  # not JSON all the way: the caller sends it as text
        parts.append(text[position:end])
        position = end
        while position < len(text) and text[position] in "; \t\r\n":
            position += 1
    return parts


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _append_text(events: list[Event], text: str) -> None:
    if text:
        events.append(ContentDelta(text))
