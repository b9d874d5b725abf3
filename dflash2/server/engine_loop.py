"""EngineLoop: the engine's side of the server, whatever carries requests to it and outputs back.

    receive() (the transport's) ──► _drain_commands ──► engine.add_request / engine.abort
                               _step ──► engine.step() ──► observer ──► deliver() (most urgent first)
    LoadModel / UnloadModel ──► weights read on a loader thread, attached between steps; an unload drains its
                               model's requests (or ends them: force) ──► answer() with the new EngineInfo

The commands, EngineInfo and the errors are engine_messages.py's. It owns the Engine, which is not thread-safe: nothing else touches it after loading. Two transports subclass it
and say how commands come in and a refusal, an output or a failure reaches the HTTP side (the hooks at the
end):
- EngineThread (engine_thread.py): a thread of the server's process, handing results to the asyncio loop;
- the engine process (engine_process.py): a process of its own, sending results back over a pipe, so that
  neither the engine's Python (plan, launch, commit: the host side of every step) nor the HTTP side's waits
  for the other's GIL.

The queue bound (`max_queue_len`): the loop refuses a request when that many are waiting in the scheduler
(preempted ones included), and the HTTP side refuses one at once when that many submissions are still on their
way (the loop is busy with a long step). So at most 2 x max_queue_len requests are held besides the running
ones, however fast clients send. Priority does not bypass the bound.

The wait bound (`max_queue_wait_s`): a count cannot say how long a line takes to drain (a thousand waiting
requests are a second on a GPU and an hour on two CPU cores), so the loop also refuses a request whose expected
wait exceeds it: the requests ahead of it in its line (those of higher priority or earlier arrival) at the
engine's recent finish rate. An urgent request skips a line of less urgent ones and is not refused for them.
Early in a burst that count reads low (only the shortest requests have finished yet: W7's 1000 requests at once
were refused as "207 s" of waiting for a line that drained in 15 s), so the rate is also taken by Little's law
(the requests running over their mean time in service), and the faster of the two is used: a bound that refuses
only what is surely too long.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash2.parallel.errors import WorkerFailed

from dflash2.request import Request, RequestOutput
from dflash2.server.engine_messages import (Abort, DescribeModels, EndAll, EngineError, EngineInfo, LoadModel,
                                            QueueFull, Stop, Submit, UnloadModel)
from dflash2.server.gc_pauses import settle_collector
from dflash2.server.observer import RequestObserver, Tracked

logger = logging.getLogger("dflash2.server")

IDLE_WAIT_S = 0.5  # how long the idle loop blocks on the command queue before a stats tick
RETRY_AFTER_RANGE_S = (1, 60)  # Retry-After is an estimate of the queue's drain time, clamped to this
RATE_WINDOW_S = 30.0  # the drain rate counts the finishes of the engine's last this many busy seconds


class FinishWindow:
    """The engine's finishes of the last RATE_WINDOW_S seconds, oldest first: when each came and, where known,
    its seconds in service (first step to finish), summed as they come and go so that a drain estimate (one a
    submission) reads the mean without a pass over the window."""

    def __init__(self) -> None:
        self._entries: collections.deque[tuple[float, float | None]] = collections.deque()
        self._service_sum = 0.0
        self._service_count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, now: float, service_s: float | None = None) -> None:
        self._entries.append((now, service_s))
        if service_s is not None:
            self._service_sum += service_s
            self._service_count += 1
        self.drop_before(now - RATE_WINDOW_S)

    def drop_before(self, start: float) -> None:
        while self._entries and self._entries[0][0] < start:
            _, service_s = self._entries.popleft()
            if service_s is not None:
                self._service_sum -= service_s
                self._service_count -= 1

    def mean_service_s(self) -> float | None:
        return self._service_sum / self._service_count if self._service_count else None


ENGINE_FAILED = "the engine failed while running this request (the server log has the error)"
MODEL_UNLOADED = "the model was unloaded while this request ran"


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], Any], observer_factory: Callable[[Any], RequestObserver],
                 max_queue_len: int | None = None, max_held_requests: int | None = None,
                 step_timeout_s: float | None = None, max_queue_wait_s: float | None = None) -> None:
        self._engine_factory = engine_factory
        self.max_queue_wait_s = max_queue_wait_s  # refuse a request expected to wait longer (None: no bound)
        self.step_timeout_s = step_timeout_s  # the watchdog's bound on one step (None: no watchdog)
        self._step_started: float | None = None  # while a step runs (the watchdog reads it)
        self._stuck: list[str] | None = None  # the requests of a step the watchdog gave up on
        self._steps_run = 0
        self._stall = _injected_stall()
        self._observer_factory = observer_factory
        self.max_queue_len = max_queue_len
        self.max_held_requests = max_held_requests  # running, paused and waiting (--max-num-seqs beside --max-batch-size)
        self._finishes = FinishWindow()
        self._busy_since: float | None = None  # when a request last came to an idle engine
        self.retry_after_s = RETRY_AFTER_RANGE_S[0]  # the latest drain estimate
        self._tracked: dict[str, Tracked] = {}
        self.engine: Any = None
        self.observer: RequestObserver | None = None
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None  # reads a new model's weights
        self._loading: list[tuple[LoadModel, concurrent.futures.Future]] = []
        self._unloading: list[UnloadModel] = []

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.engine = self._engine_factory()
            self.observer = self._observer_factory(self.engine)
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server with its message
            self.on_load_failed(e)
            return
        frozen, thresholds = settle_collector()
        if self.step_timeout_s is not None or _ranks_failure(self.engine) is not None:
            threading.Thread(target=self._watch_steps, name="dflash2-watchdog", daemon=True).start()
        self.on_loaded()
        logger.info("engine ready: model%s %s (%d objects left out of garbage collection, thresholds %s)",
                    "s" if len(self.engine.models) > 1 else "", ", ".join(self.engine.models), frozen, thresholds)
        while True:
            if not self._drain_commands(block=not self.engine.has_unfinished()):  # (a load waits up to IDLE_WAIT_S)
                break
            if self.engine.has_unfinished():
                self._step()
            if self._loading or self._unloading:
                self._change_models()
            self.observer.tick(time.monotonic())
        for request_id in list(self._tracked):
            self._abort(request_id)
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        self.engine.close()  # with an L3 cache, the prefix cache's pages go down to disk for the next server

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command; False once told to stop."""
        command = self.receive(block)
        while command is not None:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Submit):
                self._add(command)
            elif isinstance(command, Abort):
                self._abort(command.request_id)
            elif isinstance(command, LoadModel):
                self._start_load(command)
            elif isinstance(command, UnloadModel):
                self._start_unload(command)
            elif isinstance(command, EndAll):
                if self._tracked:
                    logger.warning("ending %d requests: %s", len(self._tracked), command.message)
                self._fail_all(EngineError(command.message))
            elif isinstance(command, DescribeModels):
                self.answer(command.reply, [served.describe() for served in self.engine.models.values()], None)
            else:
                self.apply(command)
            command = self.receive(False)
        return True

    def receive(self, block: bool) -> Any:
        """The next command, or None if there is none (block: wait up to IDLE_WAIT_S for one): the transport's."""
        raise NotImplementedError

    def _add(self, command: Submit) -> None:
        num_waiting = self.engine.num_waiting
        now = time.monotonic()
        if self._busy_since is None or not self.engine.has_unfinished():
            self._busy_since = now
        if self.max_queue_len is not None and num_waiting >= self.max_queue_len:
            self.retry_after_s = self._drain_estimate_s(num_waiting, now)
            self.settle(command, QueueFull(
                f"{num_waiting} requests are waiting (--max-queue-len {self.max_queue_len}); retry later",
                self.retry_after_s))
            return
        num_held = len(self.engine.requests)
        if self.max_held_requests is not None and num_held >= self.max_held_requests:
            self.retry_after_s = self._drain_estimate_s(max(1, num_waiting), now)
            self.settle(command, QueueFull(
                f"{num_held} requests are held (--max-num-seqs {self.max_held_requests}); retry later",
                self.retry_after_s))
            return
        try:
            request: Request = self.engine.add_request(command.prompt, command.params, command.priority,
                                                       command.request_id, model=command.model,
                                                       shares_prompt_with=command.shares_prompt_with)
        except ValueError as e:
            self.settle(command, e)
            return
        if self._refused_for_wait(command, request, now):
            return
        self._tracked[command.request_id] = Tracked(request, command.outputs, command.submitted_at, command.priority,
                                                    timing=command.timing)
        self.settle(command, None)

    def _refused_for_wait(self, command: Submit, request: Request, now: float) -> bool:
        """Take the just-added request back and refuse it if the line ahead of it drains slower than the wait
        bound allows."""
        if self.max_queue_wait_s is None:
            return False
        ahead = self.engine.num_waiting_ahead(request)
        if not ahead:
            return False
        wait_s = self._drain_seconds(ahead, now)
        if wait_s <= self.max_queue_wait_s:
            return False
        self.engine.abort(request.request_id)
        self.retry_after_s = self._drain_estimate_s(ahead, now)
        self.settle(command, QueueFull(
            f"{ahead} requests are ahead of this one, about {wait_s:.0f} s of waiting at the recent finish rate "
            f"(--max-queue-wait {self.max_queue_wait_s:g}); retry later", self.retry_after_s))
        return True

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return  # finished already, or never accepted
        self.engine.abort(request_id)
        self.observer.on_finished(tracked, "abort", time.monotonic())

    # -- loading and unloading models ----------------------------------------------------------------
    def _start_load(self, command: LoadModel) -> None:
        """Read the weights on the loader thread (the other models keep stepping); attached in _change_models."""
        if self._loader is None:
            self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dflash2-loader")
        name = command.spec.served_name()
        if any(name is not None and name == other.spec.served_name() for other, _ in self._loading):
            self.answer(command.reply, None, ValueError(f"a model named {name!r} is being loaded already"))
            return
        self._loading.append((command, self._loader.submit(self.engine.prepare_model, command.spec)))

    def _start_unload(self, command: UnloadModel) -> None:
        try:
            served = self.engine.served(command.name)
        except ValueError as e:
            self.answer(command.reply, None, e)
            return
        served.closing = True  # new requests for it are refused from now on
        if command.force:
            ended = [tracked for tracked in self._tracked.values() if tracked.request.model == command.name]
            for tracked in ended:
                self._abort(tracked.request.request_id)
            if ended:
                self.fail(ended, EngineError(MODEL_UNLOADED))
        self._unloading.append(command)

    def _change_models(self) -> None:
        """Attach the models whose weights are read; unload the ones whose requests are done."""
        for command, future in [item for item in self._loading if item[1].done()]:
            self._loading.remove((command, future))
            try:
                served = self.engine.attach_model(future.result())
            except (ValueError, RuntimeError) as e:
                self.answer(command.reply, None, e if isinstance(e, ValueError) else ValueError(str(e)))
                continue
            logger.info("model %s loaded while serving (%s)", served.name, served.describe()["weights"])
            self._models_changed(command.reply)
        for command in list(self._unloading):
            if any(r.model == command.name for r in self.engine.requests.values()):
                continue  # draining
            self._unloading.remove(command)
            if command.name not in self.engine.models:
                continue  # two unloads of one model: the first did it
            self.engine.unload_model(command.name, force=True)
            self._models_changed(command.reply)

    def _models_changed(self, reply: Any) -> None:
        """Tell the transport, and answer the command, with the models' new EngineInfo (built once)."""
        info = EngineInfo.of(self.engine)
        self.on_models_changed(info)
        self.answer(reply, info, None)

    def _step(self) -> None:
        started = time.monotonic()
        self._steps_run += 1
        self._step_started = started
        try:
            if self._stall is not None and self._steps_run == self._stall[1]:
                time.sleep(self._stall[0])  # DFLASH2_INJECT_STEP_STALL: the watchdog's test
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving the next ones
            logger.exception("engine step failed; aborting %d requests", len(self._tracked))
            # a parallel engine's lost rank: the clients read which and why
            self._fail_all(EngineError(str(e) if isinstance(e, WorkerFailed) else ENGINE_FAILED))
            return
        finally:
            self._step_started = None
        if self._stuck is not None:  # the step came back after the watchdog ended its requests
            stuck, self._stuck = self._stuck, None
            for request_id in stuck:
                self._abort(request_id)
            logger.warning("the stuck step finished after %.1f s; serving again", time.monotonic() - started)
            self.on_health(_ranks_failure(self.engine) or None)
        now = time.monotonic()
        self.observer.on_step(self.engine, now, now - started)
        self._handle_outputs(outputs, now)
        for request_id, reason in self.engine.take_failures():  # the request whose part of the step failed
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                logger.error("request %s failed alone: %s", request_id, reason)
                self.observer.on_finished(tracked, "error", now)
                self.fail([tracked], EngineError("the request failed in the engine (the server log has the details)"))

    # -- the watchdog ----------------------------------------------------------------------------------
    def _watch_steps(self) -> None:
        """A thread: a step running past step_timeout_s turns /health to 503 with the reason and ends the requests
        in the engine with an error (they are aborted once the step returns, if it does); the loop is never
        killed, so a step that comes back serves on. A parallel engine that lost a rank (parallel/executor.py: its
        watcher kills the others, so the step in flight raises and its requests end with why) answers 503 for good."""
        timeout = self.step_timeout_s
        ranks_failed = False
        while True:
            failure = _ranks_failure(self.engine) or None
            if failure is not None and not ranks_failed:  # a parallel engine lost a rank: for good
                ranks_failed = True
                self.on_health(failure)
            started = self._step_started
            if timeout is None:
                time.sleep(0.25)
                continue
            if started is not None and self._stuck is None and time.monotonic() - started > timeout:
                stuck = list(self._tracked)
                self._stuck = stuck
                reason = (f"an engine step has not finished in {timeout:g} s (--step-timeout); "
                          f"{len(stuck)} requests ended")
                logger.error("%s; the engine holds %d requests (%d waiting)", reason, len(self.engine.requests),
                             self.engine.num_waiting)
                self.on_health(reason)
                self.fail([self._tracked[r] for r in stuck if r in self._tracked], EngineError(
                    f"the engine is stuck: a step did not finish in {timeout:g} s; this request was ended"))
            time.sleep(min(0.25, timeout / 4))

    def _handle_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        deliveries: list[tuple[Tracked, RequestOutput]] = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self.observer.on_output(tracked, output, now)
            deliveries.append((tracked, output))
            if output.finished:
                del self._tracked[output.request_id]
                started = tracked.request.first_scheduled_time
                self._finishes.add(now, None if started is None else now - started)
                self.observer.on_finished(tracked, output.outputs[0].finish_reason or "stop", now)
        if deliveries:
            # Most urgent first: their handlers wake first, so their tokens go out first on a busy loop.
            deliveries.sort(key=lambda d: -d[0].request.priority)
            self.deliver(deliveries)

    def _drain_estimate_s(self, num_waiting: int, now: float) -> int:
        """Seconds for the `num_waiting` requests to drain at the finish rate of the engine's last busy seconds
        (up to RATE_WINDOW_S): a refused client that retries then finds room even if every client refused
        meanwhile retries too. Whole seconds, clamped to RETRY_AFTER_RANGE_S.

        The rate is finishes over the busy time, not over the span between the first and last finish: requests
        of one batch finish in the same step, and 64 finishes at one instant read as an infinite rate (the
        Retry-After of 1 s that a burst saw while draining took 8.6 s)."""
        low, high = RETRY_AFTER_RANGE_S
        return max(low, min(high, math.ceil(self._drain_seconds(num_waiting, now))))

    def _drain_seconds(self, num_waiting: int, now: float) -> float:
        """_drain_estimate_s before rounding and clamping."""
        window_start = max(now - RATE_WINDOW_S, self._busy_since if self._busy_since is not None else now)
        self._finishes.drop_before(window_start)
        busy_s = now - window_start
        if not self._finishes:  # nothing finished in busy_s seconds: at least as long again
            return busy_s
        per_finish = busy_s / len(self._finishes)
        mean_service_s = self._finishes.mean_service_s()
        if mean_service_s is not None:  # Little's law: R requests in service S s each finish one per S / R s
            per_finish = min(per_finish, mean_service_s / max(1, self.engine.num_running))
        return num_waiting * per_finish

    def _fail_all(self, error: EngineError) -> None:
        failed = []
        for request_id, tracked in list(self._tracked.items()):
            failed.append(tracked)
            self._abort(request_id)
        self.fail(failed, error)

    # -- what the transport provides -----------------------------------------------------------------
    def on_loaded(self) -> None:
        """The engine and observer are built; requests may come."""

    def on_load_failed(self, error: BaseException) -> None:
        """Building the engine raised `error`; the loop ends."""

    def settle(self, command: Submit, error: BaseException | None) -> None:
        """Answer a submission: taken (error None), refused (ValueError) or QueueFull."""
        raise NotImplementedError

    def deliver(self, deliveries: list[tuple[Tracked, RequestOutput]]) -> None:
        """Hand these outputs to their requests' handlers, in this order."""
        raise NotImplementedError

    def fail(self, failed: list[Tracked], error: EngineError) -> None:
        """These requests are lost to `error`."""
        raise NotImplementedError

    def apply(self, command: Any) -> None:
        """A command of the transport's own."""
        raise TypeError(f"unknown engine command {command!r}")

    def answer(self, reply: Any, result: Any, error: BaseException | None) -> None:
        """Answer a LoadModel / UnloadModel / DescribeModels command (`reply` is what the transport put in it)."""
        raise NotImplementedError

    def on_models_changed(self, info: EngineInfo) -> None:
        """A model was loaded or unloaded: `info` is what the HTTP side reads now."""

    def on_health(self, problem: str | None) -> None:
        """The watchdog found a stuck step (`problem`), or the step came back (None): /health says so."""


def _ranks_failure(engine: Any) -> str | None:
    """A parallel engine's lost rank (why), "" while its ranks are well; None for an engine of one process."""
    executor = getattr(engine, "executor", None)
    return None if executor is None else (executor.failure or "")


def _injected_stall() -> tuple[float, int] | None:
    """DFLASH2_INJECT_STEP_STALL="SECONDS:STEP": the engine loop sleeps that long before its STEP-th step (tests of
    the watchdog); None when unset."""
    value = os.environ.get("DFLASH2_INJECT_STEP_STALL")
    if not value:
        return None
    seconds, _, step = value.partition(":")
    return float(seconds), int(step or 1)
