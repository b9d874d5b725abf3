"""EngineThread: the EngineLoop on a thread of the server's own process, fed from the asyncio event loop.

    event loop (HTTP, SSE)                          thread "dflash2-engine" (owns the Engine)
    ─────────────────────                           ─────────────────────────────────────────
    await submit(...)  ──► commands (SimpleQueue) ──► engine.add_request()   (ValueError -> the future)
      (QueueFull at once if                             (QueueFull -> the future when --max-queue-len
       max_queue_len submits are in the command queue)    requests are already waiting)
    abort(request_id)  ──►                        ──► engine.abort()         (pages freed at once)
    asyncio.Queue per HTTP request ◄── loop.call_soon_threadsafe ◄── RequestOutputs of engine.step()

One process, so the event loop reads the loaded engine's EngineInfo directly. The engine's host work (plan,
launch, commit) and the event loop share one GIL: `dflash2 serve` runs the loop in a process of its own instead
(engine_process.py) unless --single-process asks for this; in-process users (tests, benchmarks that count the
server's objects) take this one.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from dflash2.request import RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.engine.served_model import ModelSpec
from dflash2.server.engine_loop import IDLE_WAIT_S, EngineLoop
from dflash2.server.engine_messages import (Abort, DescribeModels, EndAll, EngineError, EngineInfo, LoadModel,
                                            QueueFull, Stop, Submit, UnloadModel)
from dflash2.server.observer import RequestObserver, StreamTiming, Tracked


class EngineThread(EngineLoop):
    def __init__(self, engine_factory: Callable[[], Any], observer_factory: Callable[[Any], RequestObserver],
                 max_queue_len: int | None = None, max_held_requests: int | None = None,
                 step_timeout_s: float | None = None, max_queue_wait_s: float | None = None) -> None:
        super().__init__(engine_factory, observer_factory, max_queue_len, max_held_requests, step_timeout_s,
                         max_queue_wait_s)
        self.unhealthy: str | None = None  # why /health answers 503 (the watchdog), None when it need not
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # event loop -> engine thread
        self._num_submitting = 0  # submissions in the command queue, not yet taken or refused (event loop)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.info: EngineInfo | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()

    # -- event-loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_load_error: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._on_load_error = on_load_error
        self._thread = threading.Thread(target=self.run, name="dflash2-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.observer is not None:
            self.observer.close()

    async def shutdown(self) -> None:
        """stop(), from the app's lifespan."""
        self.stop()

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    async def submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int,
                     outputs: asyncio.Queue, timing: StreamTiming | None = None, model: str | None = None,
                     shares_prompt_with: str | None = None) -> None:
        """Queue one request; returns once the engine took it, raises ValueError if it refused it and
        QueueFull if max_queue_len requests are waiting. `shares_prompt_with`: another sample of this prompt
        (Engine.add_request).

        Its RequestOutputs (or an EngineError) then arrive on `outputs`, the last one with finished=True.
        """
        assert self._loop is not None
        if self.max_queue_len is not None and self._num_submitting >= self.max_queue_len:
            raise QueueFull(f"{self._num_submitting} requests are being queued already (--max-queue-len "
                            f"{self.max_queue_len}); retry later", self.retry_after_s)
        accepted = self._loop.create_future()
        self.commands.put(Submit(request_id, prompt, params, priority, outputs, accepted, timing, model=model,
                                 shares_prompt_with=shares_prompt_with))
        self._num_submitting += 1
        try:
            await accepted
        finally:
            self._num_submitting -= 1

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (a no-op for one already finished)."""
        self.commands.put(Abort(request_id))

    def end_all(self, message: str) -> None:
        """End every request in the engine: each one's client gets `message` as an error (the drain's end)."""
        self.commands.put(EndAll(message))

    async def load_model(self, spec: ModelSpec) -> EngineInfo:
        """Load a model beside the others; the new EngineInfo once it serves (ValueError if it cannot)."""
        return await self._call(LoadModel(spec))

    async def unload_model(self, name: str, force: bool = False) -> EngineInfo:
        """Unload a model once its requests are done (force: ended now); the new EngineInfo."""
        return await self._call(UnloadModel(name, force))

    async def describe_models(self) -> list[dict[str, Any]]:
        return await self._call(DescribeModels())

    async def _call(self, command: Any) -> Any:
        assert self._loop is not None
        command.reply = self._loop.create_future()
        self.commands.put(command)
        return await command.reply

    def first_sent(self, request_ids: list[str], at: float) -> None:
        """The HTTP side wrote these requests' first text at `at`: their StreamTiming (shared with the
        engine thread) already says so."""

    def count(self, metric: str) -> None:
        """Count one HTTP-side event (a ServerMetrics counter's attribute name)."""
        if self.observer is not None:
            getattr(self.observer.metrics, metric).inc()

    async def metrics_text(self, registry: Any) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(registry)

    # -- engine-thread side (EngineLoop's hooks) -----------------------------------------------------
    def receive(self, block: bool) -> Any:
        try:
            return self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return None

    def on_loaded(self) -> None:
        self.info = EngineInfo.of(self.engine)
        self.loaded.set()

    def on_models_changed(self, info: EngineInfo) -> None:
        self.info = info

    def on_health(self, problem: str | None) -> None:
        self.unhealthy = problem

    def answer(self, reply: Any, result: Any, error: BaseException | None) -> None:
        self._call_soon(_answer, reply, result, error)

    def on_load_failed(self, error: BaseException) -> None:
        self.load_error = error
        self.loaded.set()
        self._call_soon(self._on_load_error, error)

    def settle(self, command: Submit, error: BaseException | None) -> None:
        self._call_soon(_settle, command.accepted, error)

    def deliver(self, deliveries: list[tuple[Tracked, RequestOutput]]) -> None:
        self._call_soon(_deliver, [(tracked.outputs, output) for tracked, output in deliveries])

    def fail(self, failed: list[Tracked], error: EngineError) -> None:
        self._call_soon(_deliver, [(tracked.outputs, error) for tracked in failed])

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return  # the HTTP handler was cancelled (client gone) meanwhile; its abort follows in the queue
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _answer(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the HTTP handler is gone
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in deliveries:
        outputs.put_nowait(item)
