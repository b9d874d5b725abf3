"""Generation: the engine requests behind one HTTP request, and how the handler reads their outputs.

    handler ── Generation.start() ──► engine.submit() per prompt and sample, all at once (all or none accepted)
            ◄─ stream_batches(timeout) ◄── one asyncio.Queue shared by the prompts' outputs
               (each batch: every output queued so far, sent as one SSE write)
            ◄─ collect(request)        (waits for all to finish; a client that hangs up aborts them)
            ── abort_unfinished()     (finally: client gone, stream timed out, or error)
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest

from dflash2.engine.parallel_sampling import pick_best, sample_params
from dflash2.request import RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.server.engine_messages import EngineError
from dflash2.server.engine_process import EngineProcess
from dflash2.server.engine_thread import EngineThread
from dflash2.server.observer import StreamTiming
from dflash2.server.protocol import BadRequest


RECEIVED_AT = "dflash2.received_at"  # ASGI scope key: when the app first saw the request (time.monotonic)


class StreamTimeout(Exception):
    """No token arrived within --streaming-timeout-ms."""


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class Generation:
    """The engine requests of one HTTP request: prompt p's sample j is request_ids[p * samples_per_prompt + j], and
    choice p * n + j of the response (best_of > n: the n best of the prompt's samples, picked at the end)."""

    def __init__(self, engine: EngineThread | EngineProcess, request_id: str, request_ids: list[str],
                 received_at: float | None = None, samples_per_prompt: int = 1, n: int = 1) -> None:
        self.engine = engine
        self.samples_per_prompt = samples_per_prompt
        self.n = n
        self.timing = StreamTiming(received_at)
        self.id = request_id
        self.request_ids = request_ids
        self.index_of = {request_id: i for i, request_id in enumerate(request_ids)}
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.created = int(time.time())
        self._unfinished = set(request_ids)

    @classmethod
    async def start(cls, engine: EngineThread | EngineProcess, request_id: str, prompts: list[dict[str, Any]],
                    params: SamplingParams, priority: int, http_request: HTTPRequest | None = None,
                    response_id: str | None = None, model: str | None = None) -> Generation:
        """Submit every prompt at once (each counts against the queue bound while it is on its way, and a
        batch costs one trip to the engine, not one per prompt); if the engine refuses one, abort the others
        and raise BadRequest (a prompt it found wrong) or the refusal (QueueFull, EngineError).
        `response_id`: the id the response shows (default: request_id, which the engine's ids derive from).
        `model`: the engine's name of the model (None: the only one)."""
        samples = sample_params(params)
        count = len(prompts) * len(samples)
        ids = [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]
        received_at = http_request.scope.get(RECEIVED_AT) if http_request is not None else None
        generation = cls(engine, request_id, ids, received_at, len(samples), params.n)
        if response_id is not None:
            generation.id = response_id
        submissions = []
        for index, sub_id in enumerate(ids):
            prompt_index, sample = divmod(index, len(samples))
            leader = ids[index - sample] if sample else None  # the prompt's first sample prefills it
            submissions.append(engine.submit(sub_id, prompts[prompt_index], samples[sample], priority,
                                             generation.outputs, generation.timing, model, leader))
        try:
            results = await asyncio.gather(*submissions, return_exceptions=True)
        except BaseException:  # cancelled: the client went away
            generation.abort_unfinished()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            generation.abort_unfinished()
            refused = next((e for e in errors if isinstance(e, ValueError)), None)
            if refused is not None:
                raise BadRequest(str(refused)) from None
            raise errors[0]
        return generation

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def stream_batches(self, timeout_s: float | None) -> AsyncIterator[list[RequestOutput]]:
        """Outputs as they come, until every request finished, each batch holding every output that has
        arrived by then (at least one): a handler that fell behind a busy event loop catches up with one
        write instead of one per token. StreamTimeout after timeout_s without an output."""
        while self._unfinished:
            if self.outputs.empty():
                try:  # (wait_for costs a task per token: only when there is a timeout, and nothing queued)
                    first = await (asyncio.wait_for(self.outputs.get(), timeout_s) if timeout_s else self.outputs.get())
                except asyncio.TimeoutError:
                    raise StreamTimeout(f"no token for {1000 * timeout_s:.0f} ms") from None
            else:
                first = self.outputs.get_nowait()
            items = [first]
            while not self.outputs.empty():
                items.append(self.outputs.get_nowait())
            batch: list[RequestOutput] = []
            for item in items:
                if isinstance(item, BaseException) and batch:
                    yield batch  # what came before the error is sent first
                    batch = []
                batch.append(self._take(item))
            yield batch

    async def collect(self, http_request: HTTPRequest) -> list[RequestOutput]:
        """Every request's final output, in prompt order; ClientGone if the client hangs up first."""
        finals: dict[str, RequestOutput] = {}
        watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
        try:
            while self._unfinished:
                getter = asyncio.ensure_future(self.outputs.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    raise ClientGone()
                output = self._take(getter.result())
                if output.finished:
                    finals[output.request_id] = output
        finally:
            watcher.cancel()
        return [finals[request_id] for request_id in self.request_ids]

    def choices(self, finals: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs the response shows, in choice order: all of them, or with best_of > n each prompt's n best."""
        per_prompt = self.samples_per_prompt
        if per_prompt == self.n:
            return finals
        return [best for start in range(0, len(finals), per_prompt)
                for best in pick_best(finals[start:start + per_prompt], self.n)]

    def mark_first_sent(self, at: float) -> None:
        """The first text of this generation went to the response stream at `at` (for the request log)."""
        self.timing.first_sent_at = at
        self.engine.first_sent(self.request_ids, at)

    def abort_unfinished(self) -> None:
        for request_id in self._unfinished:
            self.engine.abort(request_id)
        self._unfinished.clear()

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item if isinstance(item, EngineError) else EngineError(str(item))
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item


async def _wait_for_disconnect(http_request: HTTPRequest) -> None:
    """Return when the client disconnects (the body has been read, so receive() waits for that alone)."""
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return
