"""EngineProcess: the EngineLoop in a process of its own, the HTTP server's default. This module is the server
process's side; the engine process's side (its loop on the pipes, the metrics renderer, its main) and the frame
format of both pipes are process_loop.py's.

    server process (event loop: HTTP, SSE)            engine process (spawned; owns the Engine)
    ──────────────────────────────────────            ─────────────────────────────────────────
    await submit() ── ("submit", ...) ──► commands pipe ──► EngineLoop.receive() (between steps,
    abort() / first_sent() / count() ─────────►                        │  and while a step waits for the device)
    metrics_text() ── ("metrics", n) ─────────►                                           │ (engine.step(),
                                                                                          │  observer: metrics,
                                                                                          │  request log)
    _Frames (the loop's read pipe) ◄── results pipe ◄── ("accepted" | "out" | "fail" | "metrics" | "ready")

Why a process: a step's host work (plan, launch, commit) is Python, and so is the HTTP side's (parsing,
SSE writes). On one GIL each waits for the other; under W3's overload the engine's host time per step was
about twice the same step's outside the server. vLLM (its engine core) and SGLang (its scheduler) run the
engine in a process of its own for the same reason.

What crosses the pipes (a pickle behind its length; both ends are the event loop's non-blocking transports on
the server's side, so neither a long prompt nor a busy engine ever blocks HTTP): a submission (token ids,
SamplingParams, priority, the HTTP side's clock readings), and per step each output as its delta (text, token
ids, their logprob entries): a request's last output comes whole. The HTTP side rebuilds RequestOutputs from them, so handlers read the same objects as
with EngineThread. Metrics and the request log stay in the engine process (its observer); /metrics asks it
for its exposition text, and --metrics-port is served from there. time.monotonic() is the host's clock, so
times taken on either side compare.

If the engine process dies, every request in flight fails with EngineError and the server stops (exit 1).
The server stops it by closing the commands pipe (it finishes the step in flight); if the server process dies,
that pipe ends all the same.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash2.request import CompletionOutput, RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.server.engine_loop import RETRY_AFTER_RANGE_S
from dflash2.server.engine_messages import EngineError, EngineInfo, QueueFull
from dflash2.server.observer import ObserverConfig, StreamTiming
from dflash2.server.process_loop import FRAME_HEADER, encode_frame, run_engine_process

logger = logging.getLogger("dflash2.server")

_STOP_TIMEOUT_S = 30.0  # the engine's close writes an L3 cache's pages down (l3_flush_timeout_s, 10 s)
@dataclass(frozen=True)
class EngineProcessSpec:
    """Everything the engine process needs, picklable (it is spawned, not forked)."""

    engine_factory: Callable[[], Any]  # a module-level function or a functools.partial of one
    observer_config: ObserverConfig
    served_model_name: str | None
    max_queue_len: int | None
    log_level: str
    request_log: bool  # request / token records go to stdout (launch._set_up_request_log)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_held_requests: int | None = None  # running, paused and waiting (EngineLoop)
    num_threads: int | None = None  # torch threads here (None: the physical cores available; cpu_threads)
    max_queue_wait_s: float | None = None  # EngineLoop's wait bound
    step_timeout_s: float | None = None  # the watchdog's bound on one step (EngineLoop)


class EngineLoadError(RuntimeError):
    """The engine process could not build the engine (the message is the original error's)."""


# -- the server's side ---------------------------------------------------------------------------------
class _Stream:
    """A request the engine took: where its outputs go, and its tokens so far (non-final outputs carry
    only their delta)."""

    __slots__ = ("outputs", "token_ids", "logprobs")

    def __init__(self, outputs: asyncio.Queue) -> None:
        self.outputs = outputs
        self.token_ids: list[int] = []
        self.logprobs: list | None = None


class EngineProcess:
    def __init__(self, spec: EngineProcessSpec, on_ready: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self._on_ready = on_ready  # called on the event loop once the engine is loaded
        self.max_queue_len = spec.max_queue_len
        self.retry_after_s = RETRY_AFTER_RANGE_S[0]
        self.info: EngineInfo | None = None
        self.load_error: BaseException | None = None
        self.unhealthy: str | None = None  # why /health answers 503 (the engine's watchdog), None when it need not
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands_out: Any = None  # the commands pipe, until the event loop's transport has it
        self._writer: asyncio.WriteTransport | None = None
        self._unsent: list[bytes] = []  # frames sent before the pipe was connected
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting: dict[str, asyncio.Future] = {}
        self._streams: dict[str, _Stream] = {}
        self._metrics_replies: dict[int, asyncio.Future] = {}
        self._replies: dict[int, asyncio.Future] = {}  # load / unload / describe, by number
        self._metrics_ids = itertools.count()
        self._stopping = False
        self._gone = False

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_load_error: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._on_load_error = on_load_error
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        commands_in, commands_out = context.Pipe(duplex=False)
        results_in, results_out = context.Pipe(duplex=False)
        self._process = context.Process(target=run_engine_process, args=(self.spec, commands_in, results_out),
                                        name="dflash2-engine", daemon=True)
        self._process.start()
        commands_in.close()
        results_out.close()
        self._commands_out = commands_out
        # Both pipes are the event loop's own transports, non-blocking: a write never waits for the engine
        # (busy with a step's host work, it reads its commands only between steps and while a step waits for
        # the device; a long prompt is more than a pipe's buffer), and frames are read as they come.
        loop.create_task(self._connect(loop, commands_out, results_in))

    async def _connect(self, loop: asyncio.AbstractEventLoop, commands_out: Any, results_in: Any) -> None:
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, commands_out)
        for frame in self._unsent:
            self._writer.write(frame)
        self._unsent.clear()
        await loop.connect_read_pipe(lambda: _Frames(self._dispatch, self._on_exit), results_in)

    async def shutdown(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Close the commands pipe (the engine stops at its end, after the step in flight) and wait for the
        engine process, the event loop running meanwhile (it closes the pipe, and reads the last results);
        kill the process after timeout_s."""
        self._stopping = True
        if self._process is None:
            return
        if self._writer is not None:
            self._writer.abort()  # (commands not yet written are moot now; the descriptor closes next turn)
        else:
            self._commands_out.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, timeout_s)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
            await loop.run_in_executor(None, self._process.join, timeout_s)

    @property
    def ready(self) -> bool:
        return self.info is not None and self.load_error is None and not self._gone

    # -- requests -------------------------------------------------------------------------------------
    async def submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int,
                     outputs: asyncio.Queue, timing: StreamTiming | None = None, model: str | None = None,
                     shares_prompt_with: str | None = None) -> None:
        """As EngineThread.submit."""
        assert self._loop is not None
        if self._gone:
            raise EngineError("the engine process has exited")
        if self.max_queue_len is not None and len(self._accepting) >= self.max_queue_len:
            raise QueueFull(f"{len(self._accepting)} requests are being queued already (--max-queue-len "
                            f"{self.max_queue_len}); retry later", self.retry_after_s)
        accepted = self._loop.create_future()
        self._accepting[request_id] = accepted
        self._streams[request_id] = _Stream(outputs)
        received_at = timing.received_at if timing is not None else None
        self._send(("submit", request_id, prompt, params, priority, received_at, time.monotonic(), model,
                    shares_prompt_with))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._accepting.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (a no-op for one already finished)."""
        self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def end_all(self, message: str) -> None:
        """As EngineThread.end_all."""
        self._send(("end_all", message))

    async def load_model(self, spec: Any) -> EngineInfo:
        """As EngineThread.load_model."""
        return await self._call("load", spec)

    async def unload_model(self, name: str, force: bool = False) -> EngineInfo:
        return await self._call("unload", name, force)

    async def describe_models(self) -> list[dict[str, Any]]:
        return await self._call("describe")

    async def _call(self, kind: str, *args: Any) -> Any:
        """A command the engine process answers with ("reply", number, result, error text)."""
        assert self._loop is not None
        if self._gone:
            raise EngineError("the engine process has exited")
        key = next(self._metrics_ids)
        reply = self._replies[key] = self._loop.create_future()
        self._send(("call", key, kind, *args))
        try:
            return await reply
        finally:
            self._replies.pop(key, None)

    def first_sent(self, request_ids: list[str], at: float) -> None:
        """The HTTP side wrote these requests' first text at `at` (for the request log)."""
        self._send(("first_sent", request_ids, at))

    def count(self, metric: str) -> None:
        """Count one HTTP-side event (a ServerMetrics counter's attribute name) in the engine's metrics."""
        self._send(("count", metric))

    async def metrics_text(self, registry: Any) -> bytes:
        """The engine process's Prometheus exposition (its metrics), after the server's own registry's."""
        from prometheus_client.exposition import generate_latest

        own = generate_latest(registry)
        if not self.ready:
            return own
        assert self._loop is not None
        key = next(self._metrics_ids)
        reply = self._metrics_replies[key] = self._loop.create_future()
        self._send(("metrics", key))
        try:
            return own + await reply
        finally:
            self._metrics_replies.pop(key, None)

    def _send(self, message: tuple) -> None:
        """One frame on the commands pipe (buffered by the transport, never blocking the event loop). Once the
        process is gone, nothing: _Frames sees the end of the results pipe and fails what is in flight."""
        if self._gone or self._stopping:
            return
        frame = encode_frame(message)
        if self._writer is None:
            self._unsent.append(frame)
        elif not self._writer.is_closing():
            self._writer.write(frame)

    # -- what comes back ------------------------------------------------------------------------------
    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            for item in message[1]:
                self._deliver(item)
        elif kind == "accepted":
            _, request_id, error = message
            future = self._accepting.get(request_id)
            if error is not None:
                self._streams.pop(request_id, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(_error_of(error))
                    if error[0] == "queue_full":
                        self.retry_after_s = error[2]
        elif kind == "fail":
            _, request_ids, text = message
            for request_id in request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.outputs.put_nowait(EngineError(text))
        elif kind == "metrics":
            future = self._metrics_replies.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "reply":
            _, key, result, error = message
            if isinstance(result, EngineInfo):
                self.info = result  # (before the waiting handler runs: it may look the new model up)
            future = self._replies.get(key)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(ValueError(error))
        elif kind == "health":
            self.unhealthy = message[1]
        elif kind == "ready":
            self.info = message[1]
            if self._on_ready is not None:
                self._on_ready()
        elif kind == "load_error":
            self.load_error = EngineLoadError(message[1])
            self._on_load_error(self.load_error)

    def _deliver(self, item: tuple) -> None:
        request_id = item[1]
        stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted meanwhile
        if item[0] == "final":
            del self._streams[request_id]
            stream.outputs.put_nowait(item[2])
            return
        _, _, delta_text, delta_token_ids, delta_logprobs = item
        stream.token_ids.extend(delta_token_ids)
        logprobs = None
        if delta_logprobs is not None:
            if stream.logprobs is None:
                stream.logprobs = []
            stream.logprobs.extend(delta_logprobs)
            logprobs = list(stream.logprobs)  # this output's own, as the engine's output had it
        completion = CompletionOutput(0, "", stream.token_ids, None, logprobs)
        stream.outputs.put_nowait(RequestOutput(request_id, None, [], None, [completion], False, 0,
                                                delta_text, delta_token_ids))

    def _on_exit(self) -> None:
        """The results pipe ended: the engine process exited (shutdown(), a crash, or a load failure it
        reported)."""
        if self._gone:
            return
        self._gone = True
        if self._stopping:
            return
        code = None
        if self._process is not None:
            self._process.join(1.0)  # reap it, for its exit code
            code = self._process.exitcode
        error = EngineError(f"the engine process exited (exit code {code})")
        for future in [*self._accepting.values(), *self._metrics_replies.values(), *self._replies.values()]:
            if not future.done():
                future.set_exception(error)
        for stream in self._streams.values():
            stream.outputs.put_nowait(error)
        self._streams.clear()
        if self.load_error is None:  # (a load failure it reported was passed on already)
            self.load_error = error if self.info is not None else EngineLoadError(str(error))
            self._on_load_error(self.load_error)


class _Frames(asyncio.Protocol):
    """The results pipe as the event loop reads it: frames (encode_frame) as they come, split anywhere."""

    def __init__(self, dispatch: Callable[[tuple], None], on_end: Callable[[], None]) -> None:
        self.dispatch = dispatch
        self.on_end = on_end
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        start = 0
        while len(buffer) - start >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(buffer, start)
            end = start + FRAME_HEADER.size + size
            if len(buffer) < end:
                break
            self.dispatch(pickle.loads(memoryview(buffer)[start + FRAME_HEADER.size:end]))
            start = end
        if start:
            del buffer[:start]

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_end()


def _error_of(error: tuple) -> BaseException:
    kind, text = error[0], error[1]
    if kind == "queue_full":
        return QueueFull(text, error[2])
    if kind == "value":
        return ValueError(text)
    return EngineError(text)
