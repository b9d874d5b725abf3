"""serve(): build the engine's process (or thread), the app and uvicorn, and run until stopped.

Startup order: uvicorn runs the app's lifespan (which starts the engine process loading the model), then
binds the port, so /health answers 503 while the model loads and 200 once it is ready. A model that fails
to load, or an engine process that dies, stops the server with exit status 1.

Shutdown (SIGTERM or SIGINT): the server drains. It keeps its port but answers new requests 503 with
Retry-After (and /health 503 "draining"), lets the requests in flight finish for up to --shutdown-timeout
seconds, then ends the rest with an error (an error event on a stream), and exits 0 once they are answered. A
second SIGINT exits at once. SIGUSR2 restarts without downtime (restart.py): a successor takes over the listening
socket, and this server drains without refusing anything.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry

from dflash2.cpu_threads import use_engine_threads, use_one_thread
from dflash2.server.app import build_app
from dflash2.server.config import ServerConfig
from dflash2.server.engine_messages import EngineError
from dflash2.server.engine_process import EngineProcess, EngineProcessSpec
from dflash2.server.engine_thread import EngineThread
from dflash2.server.gc_pauses import SERVER_GC_PAUSE_METRIC, GcPauses, settle_collector
from dflash2.server.metrics import ServerMetrics
from dflash2.server.observer import ObserverConfig, RequestObserver, request_logger
from dflash2.server.restart import Restarter, listening_socket
from dflash2.server.state import ServerState

logger = logging.getLogger("dflash2.server")


def observer_config(config: ServerConfig) -> ObserverConfig:
    return ObserverConfig(log_requests=not config.disable_log_requests, log_tokens=config.log_tokens,
                          log_stats=not config.disable_log_stats, stats_interval_s=config.stats_interval_s)


def build_state(config: ServerConfig, engine_factory: Callable[[], Any]) -> ServerState:
    """The shared server state with the engine on a thread of this process (EngineThread), which builds the
    engine, then the metrics and observer."""
    registry = CollectorRegistry()
    observer_settings = observer_config(config)

    def make_observer(engine: Any) -> RequestObserver:
        metrics = ServerMetrics(config.served_model_name or engine.model.name, registry)
        return RequestObserver(engine, metrics, observer_settings)

    return ServerState(config, EngineThread(engine_factory, make_observer, config.max_queue_len,
                                            config.max_held_requests, config.step_timeout_s,
                                            config.max_queue_wait_s), registry)


def build_process_state(config: ServerConfig, engine_factory: Callable[[], Any]) -> ServerState:
    """The shared server state with the engine in a process of its own (EngineProcess); engine_factory must
    pickle (a module-level function, or a functools.partial of one)."""
    spec = EngineProcessSpec(engine_factory, observer_config(config), config.served_model_name,
                             config.max_queue_len, config.log_level, request_log=_request_log_on(config),
                             metrics_port=config.metrics_port, metrics_host=config.host,
                             max_held_requests=config.max_held_requests, num_threads=config.num_threads,
                             step_timeout_s=config.step_timeout_s, max_queue_wait_s=config.max_queue_wait_s)
    registry = CollectorRegistry()

    def on_ready() -> None:
        """The engine is loaded: this process settles its collector as the engine's did (gc_pauses.
        settle_collector: here a long waiting line is the HTTP handlers' objects) and gets its own pause
        histogram (dflash2_server_gc_pause_seconds, beside the engine process's)."""
        frozen, thresholds = settle_collector()
        assert state.engine.info is not None
        pauses = GcPauses(config.served_model_name or state.engine.info.default.model_name, SERVER_GC_PAUSE_METRIC)
        registry.register(pauses)
        pauses.install()
        logger.info("server process: %d objects left out of garbage collection, thresholds %s", frozen, thresholds)

    state = ServerState(config, EngineProcess(spec, on_ready=on_ready), registry)
    return state  # (on_ready reads it)


def serve(config: ServerConfig, engine_factory: Callable[[], Any], command: list[str] | None = None) -> int:
    """Run the server in the foreground; returns the process exit status. `command` starts a successor on SIGUSR2
    (None: SIGUSR2 is logged and ignored)."""
    import uvicorn

    set_up_request_log(_request_log_on(config))
    single = config.single_process
    if single:
        use_engine_threads(config.num_threads)  # the engine runs on a thread of this process
    else:
        use_one_thread()  # the engine process sets its own (run_engine_process)
    state = build_state(config, engine_factory) if single else build_process_state(config, engine_factory)
    load_errors: list[BaseException] = []

    def on_load_error(error: BaseException) -> None:
        load_errors.append(error)
        if isinstance(error, EngineError):
            logger.error("%s", error)
        else:
            logger.error("the model failed to load: %s", error)
        server.should_exit = True

    app = build_app(state, on_load_error)
    if config.metrics_port is not None and single:
        from prometheus_client import start_http_server

        start_http_server(config.metrics_port, addr=config.host, registry=state.registry)
        logger.info("metrics on http://%s:%d/metrics", config.host, config.metrics_port)
    server = _draining_server_class(uvicorn)(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        access_log=config.log_level.lower() == "debug", timeout_graceful_shutdown=5),
        lambda: drain(state, config.shutdown_timeout_s),
        lambda: drain(state, config.shutdown_timeout_s, handing_over=True))
    sock = listening_socket(config.host, config.port)
    logger.info("loading the model; serving on http://%s:%d (/health answers 503 until it is loaded)",
                config.host, config.port)
    if command is not None:
        Restarter(command, sock, server.hand_over).install()
    else:
        ignore_restart_signal()
    server.run(sockets=[sock])
    if load_errors:
        error = load_errors[0]
        what = "the engine failed" if isinstance(error, EngineError) else "the model failed to load"
        print(f"error: {what}: {error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


ENDED_BY_SHUTDOWN = "the server is shutting down: this request did not finish within --shutdown-timeout"
ANSWER_GRACE_S = 5.0  # after the ended requests' errors go out, how long their handlers get to write them


async def drain(state: ServerState, timeout_s: float, handing_over: bool = False) -> None:
    """Stop taking requests (503; handing_over: a successor took the socket, so what still comes in on open
    connections is served, with Connection: close), let those in flight finish for up to timeout_s, end the rest
    with an error, and return once every request is answered (or ANSWER_GRACE_S later)."""
    if handing_over:
        state.handing_over = True
    else:
        state.draining = True
    logger.info("shutting down: draining %d requests in flight for up to %g s (%s)", state.in_flight, timeout_s,
                "a new server takes new connections" if handing_over else "new requests get 503")
    deadline = time.monotonic() + timeout_s
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        logger.warning("shutdown timeout: ending the %d requests still in flight", state.in_flight)
        state.engine.end_all(ENDED_BY_SHUTDOWN)
        deadline = time.monotonic() + ANSWER_GRACE_S
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    logger.info("drained; stopping")


def _draining_server_class(uvicorn: Any) -> type:
    """uvicorn.Server whose first SIGTERM / SIGINT drains (drain()) before it stops, and exits 0 after (uvicorn
    raises a caught signal again once it has stopped, which would end the process with that signal)."""

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: Any, drain_coroutine: Callable[[], Any],
                     hand_over_coroutine: Callable[[], Any]) -> None:
            super().__init__(config)
            self._drain_coroutine = drain_coroutine
            self._hand_over_coroutine = hand_over_coroutine
            self._draining: asyncio.Task | None = None
            self._loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self._draining is None and self.started and self._loop is not None:
                self._loop.call_soon_threadsafe(self._start_drain)
                self._draining = True  # (the task replaces it on the loop)
            elif self._draining is not None and sig == signal.SIGINT:
                logger.warning("second SIGINT: stopping now")
                self.should_exit = self.force_exit = True
            elif self._draining is None:
                self.should_exit = True  # not serving yet: stop

        def _start_drain(self, coroutine: Callable[[], Any] | None = None) -> None:
            async def drain_then_exit() -> None:
                try:
                    await (coroutine or self._drain_coroutine)()
                finally:
                    self.should_exit = True
            self._draining = asyncio.ensure_future(drain_then_exit())

        def hand_over(self) -> None:
            """A successor serves on the same socket (from a thread): stop accepting, close the idle
            connections, and drain what is left without refusing it."""
            if self._loop is not None and self._draining is None:
                self._draining = True
                self._loop.call_soon_threadsafe(self._stop_accepting)

        def _stop_accepting(self) -> None:
            for listener in self.servers:
                listener.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()  # idle ones close now; busy ones after their response
            self._start_drain(self._hand_over_coroutine)

    return DrainingServer


def ignore_restart_signal() -> None:
    """SIGUSR2 in a server started without a command line to restart with (in-process benchmarks): logged and
    ignored, since its default action would kill the server at once."""
    def on_usr2(signum: int, frame: Any) -> None:
        logger.warning("SIGUSR2 received: this server has no command line to restart with; the signal is ignored")

    signal.signal(signal.SIGUSR2, on_usr2)


def _request_log_on(config: ServerConfig) -> bool:
    return not (config.disable_log_requests and not config.log_tokens)


def set_up_request_log(enabled: bool) -> None:
    """Request and token records go to stdout as bare JSON lines, whatever --log-level says."""
    request_logger.handlers.clear()
    request_logger.propagate = False
    if not enabled:
        request_logger.disabled = True
        return
    request_logger.disabled = False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
