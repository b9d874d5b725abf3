"""serve(): build the engine thread, the app and uvicorn, and run until stopped.

Startup order: uvicorn runs the app's lifespan (which starts the engine thread loading the model), then
binds the port, so /health answers 503 while the model loads and 200 once it is ready. A model that fails
to load stops the server with exit status 1.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from dflash2.server.app import build_app
from dflash2.server.config import ServerConfig
from dflash2.server.engine_thread import EngineThread
from dflash2.server.metrics import ServerMetrics
from dflash2.server.observer import ObserverConfig, RequestObserver, request_logger
from dflash2.server.state import ServerState

logger = logging.getLogger("dflash2.server")


def build_state(config: ServerConfig, engine_factory: Callable[[], Any]) -> ServerState:
    """The shared server state; its engine thread builds the engine, then the metrics and observer."""
    registry = CollectorRegistry()
    observer_config = ObserverConfig(log_requests=not config.disable_log_requests, log_tokens=config.log_tokens,
                                     log_stats=not config.disable_log_stats,
                                     stats_interval_s=config.stats_interval_s)

    def make_observer(engine: Any) -> RequestObserver:
        metrics = ServerMetrics(config.served_model_name or engine.model.name, registry)
        state.metrics = metrics
        return RequestObserver(engine, metrics, observer_config)

    state = ServerState(config, EngineThread(engine_factory, make_observer, config.max_queue_len), registry)
    return state


def serve(config: ServerConfig, engine_factory: Callable[[], Any]) -> int:
    """Run the server in the foreground; returns the process exit status."""
    import uvicorn

    _set_up_request_log(config)
    state = build_state(config, engine_factory)
    load_errors: list[BaseException] = []

    def on_load_error(error: BaseException) -> None:
        load_errors.append(error)
        logger.error("the model failed to load: %s", error)
        server.should_exit = True

    app = build_app(state, on_load_error)
    if config.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(config.metrics_port, addr=config.host, registry=state.registry)
        logger.info("metrics on http://%s:%d/metrics", config.host, config.metrics_port)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        access_log=config.log_level.lower() == "debug", timeout_graceful_shutdown=5))
    logger.info("loading the model; serving on http://%s:%d (/health answers 503 until it is loaded)",
                config.host, config.port)
    server.run()
    if load_errors:
        print(f"error: the model failed to load: {load_errors[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _set_up_request_log(config: ServerConfig) -> None:
    """Request and token records go to stdout as bare JSON lines, whatever --log-level says."""
    request_logger.handlers.clear()
    request_logger.propagate = False
    if config.disable_log_requests and not config.log_tokens:
        request_logger.disabled = True
        return
    request_logger.disabled = False
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
