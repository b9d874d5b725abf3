"""The FastAPI app: routes, the API-key and body-size guard, and OpenAI-style errors.

Every client error is a JSON body {"error": {"message", "type", "param", "code"}}: 400 for bad input,
401 (with WWW-Authenticate: Bearer) for a missing or wrong API key, 404 for an unknown model or route, 413 for
a body over --max-request-bytes, 503 while the model loads, and 503 with a Retry-After header (seconds) when
--max-queue-len requests are already waiting or the server drains (SIGTERM: launch.drain). A 500 (a bug) says
only that it is one: the server log has the traceback; no error closes the connection. /health, /metrics, /version and /openapi.json stay open without the
key; /openapi.json describes every route's request body (the pydantic models of protocol.py).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import dflash2
from dflash2.engine.served_model import ModelSpec
from dflash2.server import restart
from dflash2.server.engine_messages import EngineError, QueueFull
from dflash2.server.generate_api import generate
from dflash2.server.generation import RECEIVED_AT, ClientGone
from dflash2.server.json_body import decode_json
from dflash2.server.metrics import CONTENT_TYPE
from dflash2.server.openai_api import INTERNAL_ERROR, create_chat_completion, create_completion, error_body
from dflash2.server.body import parse_body
from dflash2.server.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     GenerateRequest, TokenizeRequest)
from dflash2.server.state import NotReady, ServerState

logger = logging.getLogger("dflash2.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})
DRAIN_RETRY_AFTER_S = 5  # a draining server's 503s: by then a restarted one (or another replica) takes them
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/generate": GenerateRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
# answered by their own handlers; anything else a route raises is a bug (500)
_ANSWERED = (BadRequest, NotReady, QueueFull, ClientGone, EngineError)


def build_app(state: ServerState, on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        state.engine.start(asyncio.get_running_loop(), on_load_error or _log_load_error)
        if restart.is_restart_child():  # accept nothing before the engine serves: the old server still does
            while not state.engine.ready and state.engine.load_error is None:
                await asyncio.sleep(0.05)
            if state.engine.ready:
                restart.announce_ready()
        try:
            yield
        finally:  # (also when a second Ctrl+C cancels the shutdown)
            await state.engine.shutdown()

    app = FastAPI(title="dflash2", version=dflash2.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.server = state
    app.add_middleware(GuardMiddleware, state=state)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    limit = state.config.max_request_bytes

    def endpoint(model: type, handler: Callable[..., Awaitable[Response]]) -> Callable[[HTTPRequest], Any]:
        async def run(http_request: HTTPRequest) -> Response:
            try:
                state.require_ready()
                body = parse_body(model, await read_json(http_request, limit))
                return await handler(http_request, body, state)
            except _ANSWERED:
                raise
            except Exception:  # noqa: BLE001 - answered here: past the app, an error would close the connection
                logger.exception("unexpected error in %s", http_request.url.path)
                return JSONResponse(error_body(INTERNAL_ERROR, "internal_server_error", None), status_code=500)
        return run

    handlers = {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion,
                "/generate": generate, "/tokenize": tokenize, "/detokenize": detokenize}
    for path, model in BODIES.items():
        app.add_api_route(path, endpoint(model, handlers[path]), methods=["POST"], name=handlers[path].__name__)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        problem = getattr(state.engine, "unhealthy", None)
        if problem is not None:  # the watchdog: a step is stuck
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        if state.engine.ready:
            return JSONResponse({"status": "ok"})
        status = "failed" if state.engine.load_error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": dflash2.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await state.engine.metrics_text(state.registry), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        """Every model with its formats and KV use (pages used and cached now, from the engine)."""
        engine = state.require_ready()
        live = {card["name"]: card for card in await state.engine.describe_models()}
        data = []
        for name, info in engine.models.items():
            served_name = state.model_name if state.single else name
            card = live.get(name, {})
            data.append({"id": served_name, "object": "model", "created": int(state.started_at),
                         "owned_by": "dflash2", "root": name, "max_model_len": info.max_model_len,
                         "weights": info.weights, "kv_cache_dtype": info.kv_cache_dtype,
                         **{key: card[key] for key in MODEL_CARD_LIVE if key in card}})
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/models")
    async def load_model(http_request: HTTPRequest) -> Response:
        """Load a model while the others serve: {"name", "path", ...ModelSpec options}."""
        state.require_ready()
        body = await read_json(http_request, limit)
        if not isinstance(body, dict) or not isinstance(body.get("path", body.get("model")), str):
            raise BadRequest("the body must be a JSON object with the model's `path` (and optionally `name`)")
        try:
            spec = ModelSpec.from_dict(body)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        try:
            info = await state.engine.load_model(spec)
        except ValueError as e:
            raise BadRequest(str(e), code="model_exists" if "already" in str(e) else "model_load_failed",
                             status_code=409 if "already" in str(e) else 400) from None
        name = list(info.models)[-1]  # the model loaded last
        return JSONResponse({"id": name, "object": "model", "weights": info.models[name].weights,
                             "kv_cache_dtype": info.models[name].kv_cache_dtype}, status_code=201)

    @app.delete("/v1/models/{name:path}")
    async def unload_model(name: str, http_request: HTTPRequest) -> Response:
        """Unload a model: its requests finish first (?force=true: they end now with an error), then its weights
        and pages are freed."""
        engine = state.require_ready()
        force_text = http_request.query_params.get("force", "false").lower()
        if force_text not in ("true", "false", "1", "0"):
            raise BadRequest(f"force must be true or false, got {force_text!r}", param="force")
        force = force_text in ("true", "1")
        if name not in engine.models:
            raise BadRequest(f"the model {name!r} does not exist", param="model", code="model_not_found",
                             status_code=404)
        try:
            await state.engine.unload_model(name, force)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return JSONResponse({"id": name, "object": "model", "deleted": True})


MODEL_CARD_LIVE = ("kv_pages_used", "kv_pages_cached", "tokens_per_page", "running", "waiting", "max_num_seqs")


async def tokenize(_http_request: HTTPRequest, body: TokenizeRequest, state: ServerState) -> Response:
    model = state.check_model(body.model)
    if body.messages is not None:
        prompt = await model.encode_chat(body.messages, body.add_generation_prompt, check_length=False)
        token_ids = prompt["prompt_token_ids"]
    else:
        tokenizer = model.tokenizer
        token_ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    return JSONResponse({"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids})


async def detokenize(_http_request: HTTPRequest, body: DetokenizeRequest, state: ServerState) -> Response:
    model = state.check_model(body.model)
    vocab_size = model.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is not in [0, {vocab_size})", param="tokens")
    return JSONResponse({"prompt": model.decode(body.tokens)})


async def read_json(http_request: HTTPRequest, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes (also for chunked bodies), 400 if it is not JSON
    (protocol.decode_json)."""
    chunks, size = [], 0
    async for chunk in http_request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is over {limit} bytes", code="request_too_large", status_code=413)
        chunks.append(chunk)
    return decode_json(b"".join(chunks))


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document of the routes, with each POST route's request body: the routes read their bodies
    themselves (parse_body: OpenAI-style errors), so FastAPI does not see the models."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            document["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                                                      f"{model.__name__}"}}}}
        app.openapi_schema = document
    return app.openapi_schema


class GuardMiddleware:
    """API key check, an early 413 from Content-Length, and 503 while the server drains, before any route runs
    (plain ASGI, so streaming responses and client-disconnect detection pass through untouched); counts the
    requests in flight (until their response is sent whole) for the drain."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.api_key = state.config.api_key
        self.max_request_bytes = state.config.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_AT] = time.monotonic()  # the request log's http_in_ms starts here
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            response = JSONResponse(error_body("missing or invalid API key (send Authorization: Bearer <key>)",
                                               "authentication_error", "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            response = JSONResponse(error_body(f"the request body is over {self.max_request_bytes} bytes",
                                               "invalid_request_error", "request_too_large"), status_code=413)
            await response(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            response = JSONResponse(error_body("the server is shutting down; retry later", "service_unavailable",
                                               "draining"), status_code=503,
                                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send if not self.state.handing_over else _closing(send))
        finally:
            self.state.in_flight -= 1

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def _closing(send: Send) -> Send:
    """`send` with Connection: close on the response: the client's next request opens a new connection (to the
    server that took over the socket)."""
    async def send_closing(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)
    return send_closing


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BadRequest)
    async def bad_request(_request: HTTPRequest, e: BadRequest) -> Response:
        return JSONResponse(error_body(str(e), "invalid_request_error", e.code, e.param), status_code=e.status_code)

    @app.exception_handler(NotReady)
    async def not_ready(_request: HTTPRequest, e: NotReady) -> Response:
        return JSONResponse(error_body(str(e), "service_unavailable", "model_loading"), status_code=503)

    @app.exception_handler(QueueFull)
    async def queue_full(_request: HTTPRequest, e: QueueFull) -> Response:
        state: ServerState = app.state.server
        state.engine.count("num_requests_rejected")
        return JSONResponse(error_body(str(e), "service_unavailable", "queue_full"), status_code=503,
                            headers={"Retry-After": str(e.retry_after_s)})

    @app.exception_handler(ClientGone)
    async def client_gone(_request: HTTPRequest, _e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(EngineError)
    async def engine_error(_request: HTTPRequest, e: EngineError) -> Response:
        return JSONResponse(error_body(str(e), "internal_server_error", "engine_error"), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(_request: HTTPRequest, e: HTTPException) -> Response:
        error_type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), error_type, None), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: HTTPRequest, _e: Exception) -> Response:
        logger.exception("unexpected error")
        return JSONResponse(error_body(INTERNAL_ERROR, "internal_server_error", None), status_code=500)


def _log_load_error(error: BaseException) -> None:
    logger.error("the model failed to load: %s", error)
