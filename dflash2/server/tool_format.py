"""Chat completions with tool calling: each choice's output read by a tool-call reader (tool_parsers.py) into
OpenAI's `tool_calls`, whole or streamed.

    whole:   {"message": {"role": "assistant", "content": text or null, "tool_calls": [{"id", "type": "function",
              "function": {"name", "arguments"}}]}, "finish_reason": "tool_calls"}
    stream:  {"delta": {"content": ...}} for text; for each call, once it is complete:
             {"delta": {"tool_calls": [{"index": k, "id", "type": "function", "function": {"name", "arguments": ""}}]}}
             {"delta": {"tool_calls": [{"index": k, "function": {"arguments": "{...}"}}]}}
             then {"delta": {}, "finish_reason": "tool_calls"}
finish_reason is "tool_calls" when the output ended by itself with calls in it ("length" stays "length").
"""
from __future__ import annotations

from typing import Any

from dflash2.request import RequestOutput
from dflash2.server.generation import Generation
from dflash2.server.openai_api import _ChatFormat, event_text
from dflash2.server.state import ModelHandle
from dflash2.server.tool_parsers import ContentDelta, ToolCall, make_reader, parse_all
from dflash2.server.tools import ToolRequest


class ToolChatFormat(_ChatFormat):
    def __init__(self, handle: ModelHandle, generation: Generation, num_logprobs: int | None,
                 with_prompt_logprobs: bool, tools: ToolRequest, parser: str) -> None:
        super().__init__(handle, generation, num_logprobs, with_prompt_logprobs)
        self.tools = tools
        self.parser = parser
        self._readers = [self._reader() for _ in generation.request_ids]
        self._num_calls = [0] * len(generation.request_ids)

    def _reader(self) -> Any:
        return make_reader(self.parser, self.tools.choice, self.tools.named)

    def _finish_reason(self, completion: Any, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and completion.finish_reason == "stop" else completion.finish_reason

    def event_text(self, output: RequestOutput, extra: dict[str, Any]) -> str:
        return event_text(self, output, extra)  # no text-only fast path: every piece goes through the reader

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        index = self.generation.index_of[output.request_id]
        completion = output.outputs[0]
        token_ids = self._take_pending(index, output)
        if token_ids is None:
            return []
        reader = self._readers[index]
        events = reader.feed(output.delta_text) + (reader.finish() if output.finished else [])
        logprobs = self._chat_logprobs(completion.logprobs, token_ids)
        chunks = []
        for event in events:
            for delta in self._deltas(index, event):
                chunks.append(self.header([{"index": index, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": None}]))
                logprobs = None  # the tokens' logprobs go with the first chunk they made
        if output.finished:
            reason = self._finish_reason(completion, self._num_calls[index])
            chunks.append(self.header([{"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": reason}]))
        return chunks

    def _deltas(self, index: int, event: ContentDelta | ToolCall) -> list[dict[str, Any]]:
        if isinstance(event, ContentDelta):
            return [{"content": event.text}] if event.text else []
        number = self._num_calls[index]
        if number and not self.tools.parallel:
            return []  # parallel_tool_calls false: the first call only
        self._num_calls[index] += 1
        return [{"tool_calls": [{"index": number, "id": event.id, "type": "function",
                                 "function": {"name": event.name, "arguments": ""}}]},
                {"tool_calls": [{"index": number, "function": {"arguments": event.arguments}}]}]

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        response = super().whole(finals)
        for choice, output in zip(response["choices"], self.generation.choices(finals)):
            content, calls = parse_all(self._reader(), choice["message"]["content"])
            if not self.tools.parallel:
                calls = calls[:1]
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [call.as_json() for call in calls]
            choice["finish_reason"] = self._finish_reason(output.outputs[0], len(calls))
        return response
