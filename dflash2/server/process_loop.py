"""The engine process's side of EngineProcess (engine_process.py has the server's side and the whole picture):

    run_engine_process()  the spawned process's main: logging, threads, then the loop until told to stop
    _ProcessLoop          the EngineLoop reading commands from one pipe, writing results to the other
    _QuickSwitchRegistry  /metrics rendered on a thread of its own, in the loop's waits for the device
    encode_frame()        a message on either pipe: its pickle's length (8 bytes, big-endian), then the pickle
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import signal
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from dflash2.request import RequestOutput
from dflash2.server.engine_loop import IDLE_WAIT_S, EngineLoop
from dflash2.server.engine_messages import (Abort, DescribeModels, EndAll, EngineError, EngineInfo, LoadModel,
                                            QueueFull, Stop, Submit, UnloadModel)
from dflash2.server.observer import StreamTiming, Tracked

if TYPE_CHECKING:
    from dflash2.server.engine_process import EngineProcessSpec

logger = logging.getLogger("dflash2.server")

FRAME_HEADER = struct.Struct("!Q")  # a frame's length (both pipes)
# While the engine process renders a /metrics scrape (on a thread of its own), the interpreter hands the GIL
# between threads this often (CPython's default: 5 ms): the engine loop, which drops the GIL while it waits
# for the device, gets it back within
# this much of asking, and the render runs in those waits.
RENDER_SWITCH_INTERVAL_S = 0.0002
# A render takes each metric family only while the loop waits (for the device, or idle for commands), so the
# two never share the GIL while the loop has host work; past this long a render finishes without waiting (a
# loop that never waits, or a scrape that must not wait longer).
RENDER_WAIT_LIMIT_S = 0.25


class _QuickSwitchRegistry:
    """A registry whose collect() (and so the text formatted from it, generate_latest's or the --metrics-port
    server's, each on a thread of its own) runs under RENDER_SWITCH_INTERVAL_S; the interval goes back once no
    render is running (renders may overlap: the metrics port's thread and the renderer). With `loop_waits` (an
    Event the loop sets while it waits), each family is taken only while it is set, up to RENDER_WAIT_LIMIT_S
    after the render began."""

    _lock = threading.Lock()
    _renders = 0
    _previous = 0.005

    def __init__(self, registry: Any, loop_waits: threading.Event | None = None) -> None:
        self.registry = registry
        self.loop_waits = loop_waits

    def collect(self) -> Any:
        cls = type(self)
        with cls._lock:
            if cls._renders == 0:
                cls._previous = sys.getswitchinterval()
                sys.setswitchinterval(RENDER_SWITCH_INTERVAL_S)
            cls._renders += 1
        try:
            if self.loop_waits is None:
                yield from self.registry.collect()
                return
            families = iter(self.registry.collect())
            deadline = time.monotonic() + RENDER_WAIT_LIMIT_S
            while True:
                left = deadline - time.monotonic()
                if left > 0:
                    self.loop_waits.wait(left)
                family = next(families, None)
                if family is None:
                    return
                yield family
        finally:
            with cls._lock:
                cls._renders -= 1
                if cls._renders == 0:
                    sys.setswitchinterval(cls._previous)

    def restricted_registry(self, names: Any) -> _QuickSwitchRegistry:
        """As CollectorRegistry's (a scrape asking for some series by name[]: the metrics port's server)."""
        return _QuickSwitchRegistry(self.registry.restricted_registry(names), self.loop_waits)


class _ProcessLoop(EngineLoop):
    """The EngineLoop reading its commands from one pipe and answering over the other (the engine process's
    main thread does both)."""

    def __init__(self, spec: EngineProcessSpec, commands: Any, results: Any) -> None:
        super().__init__(spec.engine_factory, self._make_observer, spec.max_queue_len, spec.max_held_requests,
                         spec.step_timeout_s, spec.max_queue_wait_s)
        self.spec = spec
        self.commands_in = commands  # the commands pipe (a Connection)
        self._poller: Any = None  # select.poll() on the commands pipe: whether a command (or its end) is there
        self.results = results  # the results pipe (a Connection: only its descriptor is used)
        self.registry: Any = None
        self._send_lock = threading.Lock()  # frames whole on the results pipe: the loop and the metrics renderer
        self._scrapes: queue.SimpleQueue | None = None  # the renderer thread's work: scrape numbers
        # on CUDA, set while the loop waits (for the device: the runner sets it; for commands, idle): renders
        # run then. None on the CPU, whose steps never wait for a device (renders would wait for idle times only)
        self.loop_waits: threading.Event | None = None

    def receive(self, block: bool) -> Any:
        """The next command straight from the pipe, on the loop's own thread: a reader thread would have to win
        the GIL from this one, busy with host work under load, which takes up to the 5 ms switch interval.
        The pipe's end (the server process is gone) is a Stop."""
        try:
            if block and self.loop_waits is not None:
                self.loop_waits.set()
                try:
                    ready = self.commands_in.poll(IDLE_WAIT_S)
                finally:
                    self.loop_waits.clear()
            elif block:
                ready = self.commands_in.poll(IDLE_WAIT_S)
            else:  # one poll(2) call, no selector built
                if self._poller is None:
                    self._poller = select.poll()
                    self._poller.register(self.commands_in.fileno(), select.POLLIN)
                ready = bool(self._poller.poll(0))
            if not ready:
                return None
            fd = self.commands_in.fileno()
            (size,) = FRAME_HEADER.unpack(_read_exactly(fd, FRAME_HEADER.size))
            return _command_of(pickle.loads(_read_exactly(fd, size)))
        except (EOFError, OSError):
            return Stop()

    def send(self, message: tuple) -> None:
        """One frame on the results pipe (blocking: the server's event loop reads it as it comes)."""
        view = memoryview(encode_frame(message))
        fd = self.results.fileno()
        with self._send_lock:
            while view:
                view = view[os.write(fd, view):]

    def _make_observer(self, engine: Any) -> Any:
        from prometheus_client import CollectorRegistry

        from dflash2.server.metrics import ServerMetrics
        from dflash2.server.observer import RequestObserver

        self.registry = CollectorRegistry()
        metrics = ServerMetrics(self.spec.served_model_name or engine.model.name, self.registry)
        if engine.device.type == "cuda":
            self.loop_waits = threading.Event()
            self._share_device_waits()
        if self.spec.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(self.spec.metrics_port, addr=self.spec.metrics_host,
                              registry=_QuickSwitchRegistry(self.registry, self.loop_waits))
            logger.info("metrics on http://%s:%d/metrics", self.spec.metrics_host, self.spec.metrics_port)
        return RequestObserver(engine, metrics, self.spec.observer_config)

    def on_loaded(self) -> None:
        try:
            self.send(("ready", EngineInfo.of(self.engine)))
        except Exception as e:  # (a tokenizer that does not pickle; nothing was written: encode_frame pickles first)
            self.send(("load_error", f"the model's tokenizer and settings cannot be sent to the server process "
                                     f"({type(e).__name__}: {e}); --single-process keeps them in one process"))
            raise

    def on_load_failed(self, error: BaseException) -> None:
        self.send(("load_error", str(error)))

    def settle(self, command: Submit, error: BaseException | None) -> None:
        if error is None:
            wire = None
        elif isinstance(error, QueueFull):
            wire = ("queue_full", str(error), error.retry_after_s)
        elif isinstance(error, ValueError):
            wire = ("value", str(error))
        else:
            wire = ("engine", str(error))
        self.send(("accepted", command.request_id, wire))

    def deliver(self, deliveries: list[tuple[Tracked, RequestOutput]]) -> None:
        self.send(("out", [_wire_output(output) for _, output in deliveries]))

    def fail(self, failed: list[Tracked], error: EngineError) -> None:
        self.send(("fail", [tracked.request.request_id for tracked in failed], str(error)))

    def answer(self, reply: Any, result: Any, error: BaseException | None) -> None:
        self.send(("reply", reply, result, None if error is None else str(error)))

    def on_health(self, problem: str | None) -> None:
        self.send(("health", problem))

    def on_models_changed(self, info: EngineInfo) -> None:
        self._share_device_waits()  # (the HTTP side gets `info` with the command's reply)

    def _share_device_waits(self) -> None:
        for served in self.engine.models.values():  # every model's steps wait for the device alike
            served.runner.host_waits = self.loop_waits

    def apply(self, command: Any) -> None:
        kind = command[0]
        if kind == "first_sent":
            for request_id in command[1]:
                tracked = self._tracked.get(request_id)
                if tracked is not None and tracked.timing is not None and tracked.timing.first_sent_at is None:
                    tracked.timing.first_sent_at = command[2]
        elif kind == "count":
            if self.observer is not None:
                getattr(self.observer.metrics, command[1]).inc()
        elif kind == "metrics":
            if self._scrapes is None:
                self._scrapes = queue.SimpleQueue()
                threading.Thread(target=self._render_metrics, name="dflash2-metrics", daemon=True).start()
            self._scrapes.put(command[1])

    def _render_metrics(self) -> None:
        """The renderer thread: each scrape's exposition text, sent when ready. Rendering the registry takes a few
        milliseconds of Python (~3.7 ms for W3's server on this project's CPU); on the loop, between two steps,
        that stalled every request, twice a second under W3's scrapes (the step trace: 4-8 ms gaps before a
        plan, fifteenth session's code). Here it runs while the loop waits for the device: on CUDA each family
        only while the loop waits (loop_waits; beside the loop's host work the two threads shared the GIL, and
        a step's launch took 3-10 ms, sixteenth session's trace), and the short switch interval
        (_QuickSwitchRegistry) gives the loop the GIL back within RENDER_SWITCH_INTERVAL_S when it wants it."""
        from prometheus_client.exposition import generate_latest

        registry = _QuickSwitchRegistry(self.registry, self.loop_waits)
        while True:
            number = self._scrapes.get()
            try:
                text = generate_latest(registry)
            except Exception:  # noqa: BLE001 - a failed scrape answers empty; serving goes on
                logger.exception("rendering the engine's metrics failed")
                text = b""
            try:
                self.send(("metrics", number, text))
            except OSError:  # the server is gone: the loop sees the pipe's end
                return


def _wire_output(output: RequestOutput) -> tuple:
    """One output as it crosses the pipe: the last one whole (its token lists materialized), the others as
    their delta."""
    if output.finished:
        for completion in output.outputs:
            completion.token_ids = list(completion.token_ids)
        output.prompt_token_ids = list(output.prompt_token_ids)
        return ("final", output.request_id, output)
    completion = output.outputs[0]
    delta_logprobs = None
    if completion.logprobs is not None:
        count = len(output.delta_token_ids)
        delta_logprobs = completion.logprobs[len(completion.logprobs) - count:] if count else []
    return ("delta", output.request_id, output.delta_text, output.delta_token_ids, delta_logprobs)


def encode_frame(message: tuple) -> bytes:
    """A message as it crosses either pipe: its pickle's length (8 bytes, big-endian), then the pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(payload)) + payload


def _read_exactly(fd: int, size: int) -> bytes:
    """size bytes from a blocking descriptor; EOFError at its end."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the commands pipe ended")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _command_of(message: tuple) -> Any:
    """A commands-pipe message as the loop's command."""
    kind = message[0]
    if kind == "submit":
        _, request_id, prompt, params, priority, received_at, submitted_at, model, shares_prompt_with = message
        return Submit(request_id, prompt, params, priority, timing=StreamTiming(received_at), submitted_at=submitted_at,
                      model=model, shares_prompt_with=shares_prompt_with)
    if kind == "abort":
        return Abort(message[1])
    if kind == "end_all":
        return EndAll(message[1])
    if kind == "call":
        _, key, call, *args = message
        command = {"load": LoadModel, "unload": UnloadModel, "describe": DescribeModels}[call](*args)
        command.reply = key
        return command
    return message


def run_engine_process(spec: EngineProcessSpec, commands_in: Any, results_out: Any) -> None:
    """The engine process's main: logging as the server's, then the EngineLoop until told to stop.

    It ignores SIGINT and SIGTERM: Ctrl+C in a terminal reaches every process of the group, and a service manager's
    stop every process of the service, while the server process drains first and then stops this one itself (the
    pipe's end stops it too, if the server process dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the server process restarts (server/restart.py)
    from dflash2.cpu_threads import use_engine_threads
    from dflash2.logs import configure_logging
    from dflash2.server.launch import set_up_request_log

    configure_logging(spec.log_level)
    set_up_request_log(spec.request_log)
    use_engine_threads(spec.num_threads)
    loop = _ProcessLoop(spec, commands_in, results_out)
    try:
        loop.run()
    finally:
        if loop.observer is not None:
            loop.observer.close()
        sys.stdout.flush()
        commands_in.close()
        results_out.close()
