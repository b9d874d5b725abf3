"""One streamed request against the server, timed: TTFT, the gaps between tokens, end to end.

Supported endpoints (all streamed, SSE): /v1/completions (default), /v1/chat/completions, /generate.
Output tokens are counted from the server's usage totals where it sends them, else from the chunks.
A chunk counts as a token when it carries text, or (/generate) token ids: a model served without a
tokenizer (dummy weights on a GPU) streams ids with empty text, and its TTFT is still measured.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from dflash2.bench.dataset import BenchItem

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")


@dataclass
class RequestResult:
    priority: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    started_at: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(endpoint: str, item: BenchItem, model: str | None, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": item.max_tokens, "priority": item.priority, "stream": True,
                            "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    if endpoint == "/v1/chat/completions":
        if not isinstance(item.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not prompt_token_ids")
        body["messages"] = [{"role": "user", "content": item.prompt}]
        body["stream_options"] = {"include_usage": True}
    elif endpoint == "/generate":
        body["prompt" if isinstance(item.prompt, str) else "prompt_token_ids"] = item.prompt
    else:
        body["prompt"] = item.prompt
        body["stream_options"] = {"include_usage": True}
    return body


async def send(client: Any, url: str, endpoint: str, item: BenchItem, model: str | None, ignore_eos: bool,
               headers: dict[str, str]) -> RequestResult:
    """Send one streamed request; never raises (failures are recorded in the result)."""
    result = RequestResult(item.priority, started_at=time.perf_counter())
    try:
        async with client.stream("POST", url + endpoint, json=request_body(endpoint, item, model, ignore_eos),
                                 headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            await _read_events(response, endpoint, result)
    except Exception as e:  # noqa: BLE001 - timeouts, refused connections, broken streams: all are failures
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return result


async def _read_events(response: Any, endpoint: str, result: RequestResult) -> None:
    last = result.started_at
    chunks_with_text = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if _has_tokens(chunk, endpoint):
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - result.started_at
            else:
                result.itl_s.append(now - last)
            last = now
            chunks_with_text += 1
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
    result.latency_s = time.perf_counter() - result.started_at
    if not result.output_tokens:
        result.output_tokens = chunks_with_text
    result.ok = True


def _has_tokens(chunk: dict[str, Any], endpoint: str) -> bool:
    if endpoint == "/generate":
        return bool(chunk.get("text") or chunk.get("token_ids"))
    return bool(_text_of(chunk, endpoint))


def _text_of(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "/v1/chat/completions":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""
