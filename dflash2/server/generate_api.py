"""/generate: one prompt (text or token ids) in, text and token ids out; streamed as SSE when asked.

    {"prompt" | "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
     "priority", "stream", ...vLLM's extra sampling fields}
    -> {"id", "model", "text", "token_ids", "finish_reason", "stop_reason", "priority", "usage"}
    stream: data: {"id", "text": delta, "token_ids": delta, "finish_reason": null | reason[, "usage"]} ... [DONE]
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from dflash2.request import RequestOutput
from dflash2.server.generation import Generation
from dflash2.server.openai_api import TRUNCATION_HEADER, collect, event_text, stream_events, usage
from dflash2.server.protocol import GenerateRequest
from dflash2.server.state import ServerState


async def generate(http_request: HTTPRequest, body: GenerateRequest, state: ServerState) -> Response:
    model = state.check_model(body.model)
    prompts = [state.encode(body.prompt if body.prompt is not None else body.prompt_token_ids or [])]
    truncated = state.truncate(prompts, body.truncate_prompt_tokens)
    params = body.sampling_params(body.max_tokens, body.logprobs)
    generation = await Generation.start(state.engine, f"gen-{uuid.uuid4().hex}", prompts, params, body.priority,
                                        http_request)
    headers = TRUNCATION_HEADER if truncated else None
    formatter = _GenerateFormat(generation, model, body.priority)
    if body.stream:
        return StreamingResponse(stream_events(state, generation, formatter, include_usage=False),
                                 media_type="text/event-stream", headers=headers)
    final = (await collect(http_request, generation))[0]
    return JSONResponse(formatter.whole(final), headers=headers)


class _GenerateFormat:
    def __init__(self, generation: Generation, model: str, priority: int) -> None:
        self.generation = generation
        self.model = model
        self.priority = priority

    def header(self, _choices: list[Any]) -> dict[str, Any]:
        return {"id": self.generation.id, "model": self.model}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def event_text(self, output: RequestOutput, extra: dict[str, Any]) -> str:
        """A token's event as text around json.dumps of its text (the hot path); the last one as a dict."""
        if output.finished:
            return event_text(self, output, extra)
        prefix = getattr(self, "_prefix", None)
        if prefix is None:
            prefix = self._prefix = 'data: {"id": ' + json.dumps(self.generation.id) + ', "text": '
        token_ids = ", ".join(map(str, output.delta_token_ids))
        return f'{prefix}{json.dumps(output.delta_text, ensure_ascii=False)}, "token_ids": [{token_ids}], ' \
               f'"finish_reason": null}}\n\n'

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        completion = output.outputs[0]
        chunk = {"id": self.generation.id, "text": output.delta_text, "token_ids": output.delta_token_ids,
                 "finish_reason": completion.finish_reason if output.finished else None}
        if output.finished:
            chunk["usage"] = usage([output])
        return [chunk]

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        return {"id": self.generation.id, "model": self.model, "text": completion.text,
                "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason, "priority": self.priority, "usage": usage([output])}
