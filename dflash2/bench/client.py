"""One streamed request against the server, timed: TTFT, the gaps between tokens, end to end.

Supported endpoints (all streamed, SSE): /v1/completions (default), /v1/chat/completions, /generate.
Output tokens are counted from the server's usage totals where it sends them, else from the chunks.
A chunk counts as a token when it carries text, or (/generate) token ids: a model served without a
tokenizer (dummy weights on a GPU) streams ids with empty text, and its TTFT is still measured.

Two transports behind `send`: httpx (any URL), and for plain http:// a lean HTTP/1.1 reader on asyncio
streams (`send_raw`: one connection per request, chunked SSE parsed by hand). The load generator runs every
stream in one Python process, often beside the server on the same cores; with 128 streams at GPU token rates
httpx's per-line cost (h11, anyio, line splitting: ~100 us a token) saturates that process and its queueing
shows up as TTFT the server never caused. The lean reader costs a fraction of that.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import time
import urllib.parse
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
    started_at: float = 0.0  # time.perf_counter() when sending began (on Linux: the host-wide monotonic clock)
    request_id: str | None = None  # the "id" of the response's chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it

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
    events = _Events(endpoint, result)
    async for line in response.aiter_lines():
        if not events.line(line):
            break
    events.finish()


class _Events:
    """Turns SSE lines into the result's times and counts; `line()` is False once the stream is over
    (an error event; `[DONE]` ends it too)."""

    def __init__(self, endpoint: str, result: RequestResult) -> None:
        self.endpoint = endpoint
        self.result = result
        self.last = result.started_at
        self.chunks_with_text = 0
        self.done = False

    def line(self, line: str) -> bool:
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        result = self.result
        chunk = json.loads(data)
        if result.request_id is None:
            result.request_id = chunk.get("id")
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return False
        if _has_tokens(chunk, self.endpoint):
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - result.started_at
            else:
                result.itl_s.append(now - self.last)
            self.last = now
            self.chunks_with_text += 1
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return True

    def finish(self) -> None:
        result = self.result
        if result.error is not None:
            return
        result.latency_s = time.perf_counter() - result.started_at
        if not result.output_tokens:
            result.output_tokens = self.chunks_with_text
        result.ok = True


async def send_raw(url: str, endpoint: str, item: BenchItem, model: str | None, ignore_eos: bool,
                   headers: dict[str, str]) -> RequestResult:
    """`send` over a fresh HTTP/1.1 connection on asyncio streams (http:// only); never raises."""
    result = RequestResult(item.priority, started_at=time.perf_counter())
    writer = None
    try:
        parts = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        body = json.dumps(request_body(endpoint, item, model, ignore_eos)).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write((f"POST {parts.path.rstrip('/')}{endpoint} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{head}"
                      f"Connection: close\r\n\r\n").encode() + body)
        status, response_headers = await _read_head(reader)
        if status != 200:
            text = (await reader.read(4096)).decode(errors="replace")
            result.error = f"HTTP {status}: {text[:200]}"
            return result
        events = _Events(endpoint, result)
        pending = ""
        async for piece in _body(reader, response_headers.get("transfer-encoding") == "chunked"):
            pending += piece
            *lines, pending = pending.split("\n")
            if not all(events.line(line) for line in lines):
                break
        if result.error is None and not events.done:
            events.line(pending)
        events.finish()
    except Exception as e:  # noqa: BLE001 - timeouts, refused connections, broken streams: all are failures
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if writer is not None:
            writer.close()
    return result


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    fields = {}
    for line in head[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            fields[name.strip().lower()] = value.strip().lower()
    return status, fields


async def _body(reader: asyncio.StreamReader, chunked: bool) -> Any:
    """The response body as text pieces, as they arrive (chunked transfer decoded)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two chunks
    if not chunked:
        while piece := await reader.read(65536):
            yield decoder.decode(piece)
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield decoder.decode(data[:-2])


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
