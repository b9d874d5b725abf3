"""/generate: one prompt (text or token ids) in, text and token ids out; streamed as SSE when asked.

    {"prompt" | "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
     "priority", "stream", "prompt_logprobs", ...vLLM's extra sampling fields}
    -> {"id", "model", "text", "token_ids", "finish_reason", "stop_reason", "priority", "usage"[, "logprobs"]
        [, "prompt_logprobs"]}
    stream: data: {"id", "text": delta, "token_ids": delta[, "logprobs": delta], "finish_reason": null | reason
                   [, "usage"]} ... [DONE]
    logprobs and prompt_logprobs: per token {token id: {"logprob", "rank", "decoded_token"}} (vLLM's shape)
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from dflash2.request import RequestOutput
from dflash2.server.generation import Generation
from dflash2.server.openai_api import TRUNCATION_HEADER, event_text, logprobs_json, respond, usage
from dflash2.server.protocol import GenerateRequest
from dflash2.server.state import ModelHandle, ServerState


async def generate(http_request: HTTPRequest, body: GenerateRequest, state: ServerState) -> Response:
    model = state.check_model(body.model)
    params = body.sampling_params(body.max_tokens, body.logprobs, model.limits)
    prompt = body.prompt if body.prompt is not None else body.prompt_token_ids or []
    prompts = await model.encode([prompt], add_special_tokens=body.add_special_tokens is not False,
                                 check_length=body.truncate_prompt_tokens is None)
    truncated = model.truncate(prompts, body.truncate_prompt_tokens)
    generation = await Generation.start(state.engine, f"gen-{uuid.uuid4().hex}", prompts, params, body.priority,
                                        http_request, response_id=body.request_id, model=model.engine_name)
    headers = TRUNCATION_HEADER if truncated else None
    formatter = _GenerateFormat(model, generation, body.priority, body.logprobs is not None,
                                body.prompt_logprobs is not None)
    return await respond(http_request, state, generation, formatter, params, headers, body.stream,
                         include_usage=False)


class _GenerateFormat:
    def __init__(self, handle: ModelHandle, generation: Generation, priority: int, with_logprobs: bool,
                 with_prompt_logprobs: bool) -> None:
        self.handle = handle
        self.generation = generation
        self.model = handle.name
        self.priority = priority
        self.with_logprobs = with_logprobs
        self.with_prompt_logprobs = with_prompt_logprobs

    def header(self, _choices: list[Any]) -> dict[str, Any]:
        return {"id": self.generation.id, "model": self.model}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def event_text(self, output: RequestOutput, extra: dict[str, Any]) -> str:
        """A token's event as text around json.dumps of its text (the hot path); the last one, and those with
        logprobs, as a dict."""
        if output.finished or self.with_logprobs:
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
        if self.with_logprobs:
            entries = completion.logprobs or []
            count = len(output.delta_token_ids)
            chunk["logprobs"] = logprobs_json(self.handle, entries[len(entries) - count:] if count else [])
        if output.finished:
            chunk["usage"] = usage([output])
        return [chunk]

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        output = finals[0]
        completion = output.outputs[0]
        response = {"id": self.generation.id, "model": self.model, "text": completion.text,
                    "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason, "priority": self.priority, "usage": usage([output])}
        if self.with_logprobs:
            response["logprobs"] = logprobs_json(self.handle, completion.logprobs)
        if self.with_prompt_logprobs:
            response["prompt_logprobs"] = logprobs_json(self.handle, output.prompt_logprobs)
        return response
