"""EngineThread: the Engine on a thread of its own, fed from the asyncio event loop.

    event loop (HTTP, SSE)                          thread "dflash2-engine" (owns the Engine)
    ─────────────────────                           ─────────────────────────────────────────
    await submit(...)  ──► commands (SimpleQueue) ──► engine.add_request()   (ValueError -> the future)
      (QueueFull at once if                             (QueueFull -> the future when --max-queue-len
       max_queue_len submits are in the command queue)    requests are already waiting)
    abort(request_id)  ──►                        ──► engine.abort()         (pages freed at once)
    asyncio.Queue per HTTP request ◄── loop.call_soon_threadsafe ◄── RequestOutputs of engine.step()

The Engine is not thread-safe, so nothing but this thread touches it after loading; the event loop only
reads what never changes once loaded (tokenizer, model name, max_model_len). A thread, not a process:
the step's heavy work (torch kernels on the CPU, kernel launches and waits on the GPU) runs with the GIL
released, so the event loop keeps serving HTTP while a step runs; a process would add a serialization hop
per token and a second copy of the tokenizer for no gain at this scale.

The queue bound (`max_queue_len`): the engine thread refuses a request when that many are waiting in the
scheduler (preempted ones included), and the event loop refuses one at once when that many submissions are
still in the command queue (the engine thread is busy with a long step). So at most 2 x max_queue_len
requests are held besides the running ones, however fast clients send. Priority does not bypass the bound.
"""
from __future__ import annotations

import asyncio
import collections
import gc
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash2.request import Request, RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.server.gc_pauses import space_full_collections
from dflash2.server.observer import RequestObserver, StreamTiming, Tracked

logger = logging.getLogger("dflash2.server")

_IDLE_WAIT_S = 0.5  # how long the idle thread blocks on the command queue before a stats tick
_RETRY_AFTER_RANGE_S = (1, 60)  # Retry-After is an estimate of the queue's drain time, clamped to this
_FINISH_WINDOW = 64  # finishes the drain-rate estimate looks back over


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (the model's modules, torch, transformers, the graphs:
    ~300k objects) out of the collector's reach. A full collection otherwise walks all of them, a pause of the
    whole server (engine thread and event loop alike; 222 ms measured on this project's 2-core CPU after
    loading the bundled model) whenever the objects allocated per token trigger one. The server is one
    long-lived process, so nothing alive now is expected to become garbage (offline LLM() users keep the
    collector as it is). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class EngineError(RuntimeError):
    """The engine failed while running a request (a bug, or the device failed); the request is lost."""


class QueueFull(Exception):
    """--max-queue-len requests are already waiting (503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Submit:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
    priority: int
    outputs: asyncio.Queue
    accepted: asyncio.Future
    timing: StreamTiming | None = None
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class EngineThread:
    def __init__(self, engine_factory: Callable[[], Any], observer_factory: Callable[[Any], RequestObserver],
                 max_queue_len: int | None = None) -> None:
        self._engine_factory = engine_factory
        self.max_queue_len = max_queue_len
        self._num_submitting = 0  # submissions in the command queue, not yet taken or refused (event loop)
        self._finish_times: collections.deque[float] = collections.deque(maxlen=_FINISH_WINDOW)
        self.retry_after_s = _RETRY_AFTER_RANGE_S[0]  # the latest drain estimate (written by the engine thread)
        self._observer_factory = observer_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, Tracked] = {}
        self.engine: Any = None
        self.observer: RequestObserver | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()

    # -- event-loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_load_error: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._on_load_error = on_load_error
        self._thread = threading.Thread(target=self._run, name="dflash2-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.observer is not None:
            self.observer.close()

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    async def submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams, priority: int,
                     outputs: asyncio.Queue, timing: StreamTiming | None = None) -> None:
        """Queue one request; returns once the engine took it, raises ValueError if it refused it and
        QueueFull if max_queue_len requests are waiting.

        Its RequestOutputs (or an EngineError) then arrive on `outputs`, the last one with finished=True.
        """
        assert self._loop is not None
        if self.max_queue_len is not None and self._num_submitting >= self.max_queue_len:
            raise QueueFull(f"{self._num_submitting} requests are being queued already (--max-queue-len "
                            f"{self.max_queue_len}); retry later", self.retry_after_s)
        accepted = self._loop.create_future()
        self._commands.put(_Submit(request_id, prompt, params, priority, outputs, accepted, timing))
        self._num_submitting += 1
        try:
            await accepted
        finally:
            self._num_submitting -= 1

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (a no-op for one already finished)."""
        self._commands.put(_Abort(request_id))

    # -- engine-thread side --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
            self.observer = self._observer_factory(self.engine)
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server with its message
            self.load_error = e
            self.loaded.set()
            self._call_soon(self._on_load_error, e)
            return
        frozen = freeze_startup_objects()
        thresholds = space_full_collections()
        self.loaded.set()
        logger.info("engine ready: model %s (%d objects left out of garbage collection, thresholds %s)",
                    self.engine.model.name, frozen, thresholds)
        while True:
            if not self._drain_commands(block=not self.engine.has_unfinished()):
                break
            if self.engine.has_unfinished():
                self._step()
            self.observer.tick(time.monotonic())
        for request_id in list(self._tracked):
            self._abort(request_id)

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command; False once told to stop."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._add(command)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Submit) -> None:
        num_waiting = len(self.engine.scheduler.waiting)
        if self.max_queue_len is not None and num_waiting >= self.max_queue_len:
            self.retry_after_s = self._drain_estimate_s(num_waiting)
            self._call_soon(_settle, command.accepted, QueueFull(
                f"{num_waiting} requests are waiting (--max-queue-len {self.max_queue_len}); retry later",
                self.retry_after_s))
            return
        try:
            request: Request = self.engine.add_request(command.prompt, command.params, command.priority,
                                                       command.request_id)
        except ValueError as e:
            self._call_soon(_settle, command.accepted, e)
            return
        self._tracked[command.request_id] = Tracked(request, command.outputs, command.submitted_at, command.priority,
                                                    timing=command.timing)
        self._call_soon(_settle, command.accepted, None)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return  # finished already, or never accepted
        self.engine.abort(request_id)
        self.observer.on_finished(tracked, "abort", time.monotonic())

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving the next ones
            logger.exception("engine step failed; aborting %d requests", len(self._tracked))
            self._fail_all(EngineError(f"the engine failed: {e}"))
            return
        now = time.monotonic()
        self.observer.on_step(self.engine, now, now - started)
        deliveries: list[tuple[int, asyncio.Queue, RequestOutput]] = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self.observer.on_output(tracked, output, now)
            deliveries.append((tracked.request.priority, tracked.outputs, output))
            if output.finished:
                del self._tracked[output.request_id]
                self._finish_times.append(now)
                self.observer.on_finished(tracked, output.outputs[0].finish_reason or "stop", now)
        if deliveries:
            # Most urgent first: their handlers wake first, so their tokens go out first on a busy loop.
            deliveries.sort(key=lambda d: -d[0])
            self._call_soon(_deliver, [(queue, output) for _, queue, output in deliveries])

    def _drain_estimate_s(self, num_waiting: int) -> int:
        """Seconds until the queue has room, at the recent finish rate (whole seconds, clamped)."""
        low, high = _RETRY_AFTER_RANGE_S
        if len(self._finish_times) < 2:
            return low
        span = self._finish_times[-1] - self._finish_times[0]
        if span <= 0:
            return low
        rate = (len(self._finish_times) - 1) / span
        return max(low, min(high, math.ceil((num_waiting - self.max_queue_len + 1) / rate)))

    def _fail_all(self, error: EngineError) -> None:
        deliveries = []
        for request_id, tracked in list(self._tracked.items()):
            deliveries.append((tracked.outputs, error))
            self._abort(request_id)
        self._call_soon(_deliver, deliveries)

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


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in deliveries:
        outputs.put_nowait(item)
