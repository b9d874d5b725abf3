"""/v1/completions and /v1/chat/completions: OpenAI's request and response shapes, streamed or whole.

A stream is server-sent events, one JSON chunk per `data:` line, closed by `data: [DONE]`:

    completions: {"object": "text_completion", "choices": [{"index", "text", "logprobs", "finish_reason"}]}
    chat:        {"object": "chat.completion.chunk", "choices": [{"index", "delta", "logprobs", "finish_reason"}]}
                 first delta {"role": "assistant", "content": ""}, then {"content": ...}, last {} + finish_reason
    with stream_options.include_usage: every chunk has "usage": null and one last chunk has "choices": [] and
    the usage totals. A stream that fails (timeout, engine error) sends {"error": {...}} before [DONE].
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from dflash2.request import RequestOutput
from dflash2.server.generation import Generation, StreamTimeout
from dflash2.server.engine_messages import EngineError
from dflash2.server.protocol import ChatCompletionRequest, CompletionRequest
from dflash2.server.state import ModelHandle, ServerState
from dflash2.server.tools import ToolRequest, choose_parser

logger = logging.getLogger("dflash2.server")

TRUNCATION_HEADER = {"X-Warning": "prompt_truncated"}
INTERNAL_ERROR = "internal error (the server log has the details)"


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_body(message: str, error_type: str, code: int | str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(finals: list[RequestOutput], samples_per_prompt: int = 1) -> dict[str, Any]:
    """Token counts of a response: each prompt once (not once a sample), every sample's tokens (best_of's too)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals[::samples_per_prompt])
    completion = sum(len(o.outputs[0].token_ids) for o in finals)
    cached = sum(o.num_cached_tokens for o in finals[::samples_per_prompt])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- /v1/completions ---------------------------------------------------------------------------------
async def create_completion(http_request: HTTPRequest, body: CompletionRequest, state: ServerState) -> Response:
    model = state.check_model(body.model)
    limits = model.limits
    params = body.sampling_params(body.max_tokens, body.logprobs, limits)
    truncating = body.truncate_prompt_tokens is not None
    prompts = await model.encode(body.prompts(limits), check_length=not truncating,
                                 add_special_tokens=body.add_special_tokens is not False and not body.suffix)
    truncated = model.truncate(prompts, body.truncate_prompt_tokens)
    if body.suffix:
        prompts = await model.fill_in_the_middle(prompts, body.suffix)
    generation = await Generation.start(state.engine, f"cmpl-{uuid.uuid4().hex}", prompts, params, body.priority,
                                        http_request, response_id=_response_id("cmpl", body.request_id),
                                        model=model.engine_name)
    headers = TRUNCATION_HEADER if truncated else None
    echo = [model.decode(p["prompt_token_ids"]) if p["prompt"] is None else p["prompt"] for p in prompts] \
        if body.echo else None
    formatter = _CompletionFormat(model, generation, body.logprobs, echo, body.prompt_logprobs is not None)
    return await respond(http_request, state, generation, formatter, params, headers, body.stream,
                         _usage_streamed(body))


async def respond(http_request: HTTPRequest, state: ServerState, generation: Generation, formatter: Any,
                  params: Any, headers: dict | None, stream: bool, include_usage: bool) -> Response:
    """The stream of events or the whole response once every sample has finished (every endpoint's answer)."""
    if stream:
        return StreamingResponse(stream_events(state, generation, formatter, include_usage),
                                 media_type="text/event-stream", headers=headers)
    finals = await collect(http_request, generation)
    return JSONResponse(await whole(formatter, finals, params), headers=headers)


def _usage_streamed(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _response_id(prefix: str, request_id: str | None) -> str | None:
    """The client's request_id (vLLM's field) as the response's id."""
    return None if request_id is None else f"{prefix}-{request_id}"


async def whole(formatter: Any, finals: list[RequestOutput], params: Any) -> dict[str, Any]:
    """The response body of a request that does not stream; built on a worker thread when it has logprobs
    (each one's token text decoded: many tokens for a long prompt)."""
    if params.logprobs is None and params.prompt_logprobs is None:
        return formatter.whole(finals)
    return await asyncio.to_thread(formatter.whole, finals)


def logprobs_json(handle: ModelHandle, entries: list[dict | None] | None) -> list[dict | None] | None:
    """Logprob entries in vLLM's shape (its `prompt_logprobs`; /generate's `logprobs` too): per token
    {token id: {"logprob", "rank", "decoded_token"}}, the token itself and the top ones (a prompt's first token
    has none: null)."""
    if entries is None:
        return None
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = handle.decode([token_id])
        return texts[token_id]

    return [None if entry is None else
            {str(token_id): {"logprob": _json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": text(token_id)}
             for token_id, lp in entry.items()}
            for entry in entries]


def _json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN (a masked or overflowed logit) as OpenAI's -9999.0."""
    return value if value >= -9999.0 else -9999.0


def event_text(formatter: Any, output: RequestOutput, extra: dict[str, Any]) -> str:
    """The SSE text of one output's chunks, each with `extra` fields (the slow, general path)."""
    return "".join(sse({**chunk, **extra}) for chunk in formatter.chunks(output))


def _json_prefix(fields: dict[str, Any]) -> str:
    """'{"a": 1, "b": ' - the start of json.dumps of a dict whose next key comes next, for hot-path events
    built as text (byte for byte what json.dumps of the whole dict gives)."""
    return json.dumps(fields, ensure_ascii=False)[:-1] + ", "


class _CompletionFormat:
    """Chunks of /v1/completions. A token's chunk on the hot path (no logprobs, not the last) is built as
    text around json.dumps of its text, not as dicts: with many open streams the event loop spends its
    time per token, and this is most of what is ours of it."""

    object_name = "text_completion"

    def __init__(self, handle: ModelHandle, generation: Generation, num_logprobs: int | None,
                 echo: list[str] | None, with_prompt_logprobs: bool = False) -> None:
        self.handle = handle
        self.generation = generation
        self.model = handle.name
        self.num_logprobs = num_logprobs
        self.echo = echo
        self.with_prompt_logprobs = with_prompt_logprobs
        self._text_offset = [0] * len(generation.request_ids)
        self._pending_ids: list[list[int]] = [[] for _ in generation.request_ids]  # tokens not yet sent

    def _take_pending(self, index: int, output: RequestOutput) -> list[int] | None:
        """The tokens a chunk for this output covers (those whose text was held back included), or None
        while its text is still held back (half a character, a possible stop string)."""
        pending = self._pending_ids[index]
        pending.extend(output.delta_token_ids)
        if not output.delta_text and not output.finished:
            return None
        self._pending_ids[index] = []
        return pending

    def header(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.generation.id, "object": self.object_name,
                "created": self.generation.created, "model": self.model, "choices": choices}

    def event_text(self, output: RequestOutput, extra: dict[str, Any]) -> str:
        if self.num_logprobs is not None or output.finished:
            return event_text(self, output, extra)
        index = self.generation.index_of[output.request_id]
        if self._take_pending(index, output) is None:
            return ""
        return self._hot_event(index, output.delta_text, extra)

    def _hot_event(self, index: int, text: str, extra: dict[str, Any]) -> str:
        return self._sse_choice(index, f'"text": {json.dumps(text, ensure_ascii=False)}', extra)

    def _sse_choice(self, index: int, content: str, extra: dict[str, Any]) -> str:
        """One SSE event of one choice's text, written as text (byte-identical to the dict path)."""
        prefix = getattr(self, "_prefix", None)
        if prefix is None:
            prefix = self._prefix = "data: " + _json_prefix({k: v for k, v in self.header([]).items()
                                                             if k != "choices"}) + '"choices": [{"index": '
        tail = ', "usage": null}\n\n' if "usage" in extra else "}\n\n"
        return f'{prefix}{index}, {content}, "logprobs": null, "finish_reason": null}}]{tail}'

    def opening(self) -> list[dict[str, Any]]:
        if self.echo is None:
            return []
        n = self.generation.n
        return [self.header([{"index": i, "text": self.echo[i // n], "logprobs": None, "finish_reason": None}])
                for i in range(len(self.generation.request_ids))]

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        index = self.generation.index_of[output.request_id]
        completion = output.outputs[0]
        token_ids = self._take_pending(index, output)
        if token_ids is None:
            return []
        logprobs = self._logprobs(index, completion.logprobs, token_ids)
        return [self.header([{"index": index, "text": output.delta_text, "logprobs": logprobs,
                              "finish_reason": completion.finish_reason if output.finished else None}])]

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(self.generation.choices(finals)):
            completion = output.outputs[0]
            prefix = self.echo[index // self.generation.n] if self.echo else ""
            if self.echo and self.num_logprobs is not None:  # OpenAI: the echoed prompt's tokens come first
                self._text_offset[index] = 0
                echoed = self._logprobs(index, output.prompt_logprobs, output.prompt_token_ids, True)
                logprobs = _joined(echoed, self._logprobs(index, completion.logprobs, completion.token_ids))
            else:
                self._text_offset[index] = len(prefix)
                logprobs = self._logprobs(index, completion.logprobs, completion.token_ids)
            choice = {"index": index, "text": prefix + completion.text, "finish_reason": completion.finish_reason,
                      "stop_reason": completion.stop_reason, "logprobs": logprobs}
            if self.with_prompt_logprobs:
                choice["prompt_logprobs"] = logprobs_json(self.handle, output.prompt_logprobs)
            choices.append(choice)
        return {**self.header(choices), "usage": usage(finals, self.generation.samples_per_prompt)}

    def _logprobs(self, index: int, entries: list[dict | None] | None, token_ids: list[int],
                  whole_prompt: bool = False) -> dict[str, Any] | None:
        """OpenAI's completion logprobs of the last len(token_ids) entries (whole_prompt: of all of them, the
        first of which is None: a prompt's first token has no logprob)."""
        if self.num_logprobs is None or entries is None or not token_ids:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries if whole_prompt else entries[-len(token_ids):]):
            text = self.handle.decode([token_id])
            tokens.append(text)
            token_logprobs.append(None if entry is None else _json_logprob(entry[token_id].logprob))
            top.append(None if entry is None else
                       {self.handle.decode([t]): _json_logprob(lp.logprob) for t, lp in _top(entry, self.num_logprobs)})
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


# -- /v1/chat/completions ----------------------------------------------------------------------------
async def create_chat_completion(http_request: HTTPRequest, body: ChatCompletionRequest,
                                 state: ServerState) -> Response:
    model = state.check_model(body.model)
    tools = ToolRequest.of(body.tools, body.tool_choice, body.parallel_tool_calls)
    params = body.sampling_params(body.requested_max_tokens, body.num_logprobs, model.limits,
                                  tools.forced_output() if tools is not None else None)
    truncating = body.truncate_prompt_tokens is not None
    prompts = [await model.encode_chat(body.messages, body.add_generation_prompt, body.continue_final_message,
                                       body.chat_template_kwargs, add_special_tokens=bool(body.add_special_tokens),
                                       check_length=not truncating, tools=tools.tools if tools is not None else None)]
    truncated = model.truncate(prompts, body.truncate_prompt_tokens)
    generation = await Generation.start(state.engine, f"chatcmpl-{uuid.uuid4().hex}", prompts, params,
                                        body.priority, http_request,
                                        response_id=_response_id("chatcmpl", body.request_id),
                                        model=model.engine_name)
    headers = TRUNCATION_HEADER if truncated else None
    if tools is None:
        formatter = _ChatFormat(model, generation, body.num_logprobs, body.prompt_logprobs is not None)
    else:
        from dflash2.server.tool_format import ToolChatFormat  # (it builds on _ChatFormat, below)

        formatter = ToolChatFormat(model, generation, body.num_logprobs, body.prompt_logprobs is not None, tools,
                                   choose_parser(state.config.tool_call_parser, model.chat_template))
    return await respond(http_request, state, generation, formatter, params, headers, body.stream,
                         _usage_streamed(body))


class _ChatFormat(_CompletionFormat):
    object_name = "chat.completion.chunk"

    def __init__(self, handle: ModelHandle, generation: Generation, num_logprobs: int | None,
                 with_prompt_logprobs: bool = False) -> None:
        super().__init__(handle, generation, num_logprobs, None, with_prompt_logprobs)

    def opening(self) -> list[dict[str, Any]]:
        return [self.header([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.generation.request_ids))]

    def _hot_event(self, index: int, text: str, extra: dict[str, Any]) -> str:
        return self._sse_choice(index, f'"delta": {{"content": {json.dumps(text, ensure_ascii=False)}}}', extra)

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        index = self.generation.index_of[output.request_id]
        completion = output.outputs[0]
        chunks = []
        token_ids = self._take_pending(index, output)
        if output.delta_text:
            logprobs = self._chat_logprobs(completion.logprobs, token_ids or [])
            chunks.append(self.header([{"index": index, "delta": {"content": output.delta_text},
                                        "logprobs": logprobs, "finish_reason": None}]))
        if output.finished:
            chunks.append(self.header([{"index": index, "delta": {}, "logprobs": None,
                                        "finish_reason": completion.finish_reason}]))
        return chunks

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [{"index": index, "message": {"role": "assistant", "content": output.outputs[0].text},
                    "logprobs": self._chat_logprobs(output.outputs[0].logprobs, output.outputs[0].token_ids),
                    "finish_reason": output.outputs[0].finish_reason, "stop_reason": output.outputs[0].stop_reason}
                   for index, output in enumerate(self.generation.choices(finals))]
        response = {**self.header(choices), "object": "chat.completion",
                    "usage": usage(finals, self.generation.samples_per_prompt)}
        if self.with_prompt_logprobs:  # vLLM: the response's, not a choice's
            response["prompt_logprobs"] = logprobs_json(self.handle, finals[0].prompt_logprobs)
        return response

    def _chat_logprobs(self, entries: list[dict] | None, token_ids: list[int]) -> dict[str, Any] | None:
        if self.num_logprobs is None or entries is None or not token_ids:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries[-len(token_ids):]):
            content.append({**self._token(token_id, _json_logprob(entry[token_id].logprob)),
                            "top_logprobs": [self._token(t, _json_logprob(lp.logprob))
                                             for t, lp in _top(entry, self.num_logprobs)]})
        return {"content": content}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.handle.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _top(entry: dict, k: int) -> list[tuple[int, Any]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)


# -- shared ------------------------------------------------------------------------------------------
async def collect(http_request: HTTPRequest, generation: Generation) -> list[RequestOutput]:
    try:
        return await generation.collect(http_request)
    finally:
        generation.abort_unfinished()


async def stream_events(state: ServerState, generation: Generation, formatter: Any,
                        include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of one streamed generation; aborts what is left when it ends for any reason."""
    timeout_ms = state.config.streaming_timeout_ms
    finals: list[RequestOutput] = []
    extra = {"usage": None} if include_usage else {}
    try:
        for chunk in formatter.opening():
            yield sse({**chunk, **extra})
        async for outputs in generation.stream_batches(timeout_ms / 1000.0 if timeout_ms else None):
            events = []
            for output in outputs:
                events.append(formatter.event_text(output, extra))
                if output.finished:
                    finals.append(output)
            text = "".join(events)  # one write for all the tokens that piled up while the loop was busy
            if text:
                if generation.timing.first_sent_at is None:
                    generation.mark_first_sent(time.monotonic())  # the first token the client can see
                yield text
        if include_usage:
            finals.sort(key=lambda output: generation.index_of[output.request_id])
            yield sse({**formatter.header([]), "usage": usage(finals, generation.samples_per_prompt)})
        state.engine.count("streaming_success")
    except StreamTimeout as e:
        state.engine.count("streaming_timeout")
        yield sse(error_body(str(e), "timeout_error", 504))
    except EngineError as e:
        yield sse(error_body(str(e), "internal_server_error", 500))
    except Exception:  # noqa: BLE001 - a bug: the client gets an error event, the log the traceback
        logger.exception("a stream failed")
        yield sse(error_body(INTERNAL_ERROR, "internal_server_error", 500))
    finally:
        generation.abort_unfinished()
    yield sse("[DONE]")
