"""EngineThread with a fake engine: requests in through the command queue, outputs back on the event loop,
refusals, aborts, a failing step, a failing load. No model, no HTTP."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from dflash2.engine.kv.page_pool import PagePool
from dflash2.request import CompletionOutput, Request, RequestOutput, RequestStatus
from dflash2.sampling_params import SamplingParams
from dflash2.server.engine_messages import EngineError, QueueFull
from dflash2.server.engine_thread import EngineThread
from dflash2.server.metrics import GpuReading, ServerMetrics, priority_class
from dflash2.server.observer import ObserverConfig, RequestObserver


class FakeEngine:
    """One token per step per request; a request takes one page of the pool while it runs."""

    def __init__(self, fail_step: bool = False) -> None:
        self.pool = PagePool(8, 1024)
        self.kv = SimpleNamespace(tokens_per_page=4, num_prefix_queries=0, num_prefix_hits=0, num_swapped_requests=0,
                                  num_used=0, num_cached=0, num_prefix_hits_host=0, num_prefix_hits_disk=0,
                                  num_spills=0)
        self.host_pool = self.disk_tier = None  # no KV tiers below the device
        self.scheduler = SimpleNamespace(running={}, waiting=[], num_preemptions=0, num_swap_outs=0, swapped_bytes=0)
        self.device = SimpleNamespace(type="cpu")
        self.model = SimpleNamespace(name="fake", device=self.device, arch=SimpleNamespace(vocab_size=100),
                                     quant=None)
        self.max_model_len = 64
        self.tokenizer = None
        served = SimpleNamespace(name="fake", scheduler=self.scheduler, kv=self.kv, model=self.model, tokenizer=None,
                                 max_model_len=64, describe=lambda: {"weights": "fake", "kv_cache_dtype": "fp32"})
        self.models = {"fake": served}
        self.last_plan_seconds = 0.0
        self.fail_step = fail_step
        self.aborted: list[str] = []
        self.pages: dict[str, list[int]] = {}
        self.requests = self.scheduler.running  # every request it holds runs here
        self.closed = False

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def add_request(self, prompt, params, priority, request_id, model=None, shares_prompt_with=None) -> Request:
        if prompt["prompt_token_ids"] == [0]:
            raise ValueError("token 0 is refused")
        request = Request(request_id, prompt["prompt_token_ids"], params, priority=priority, model="fake")
        self.scheduler.running[request_id] = request
        self.pages[request_id] = self.pool.allocate(1)
        return request

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._free(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running)

    def close(self) -> None:
        self.closed = True

    def take_failures(self) -> list[tuple[str, str]]:
        return []  # no request of this engine fails alone

    def step(self) -> list[RequestOutput]:
        if self.fail_step:
            raise RuntimeError("device lost")
        outputs = []
        for request in list(self.scheduler.running.values()):
            request.token_ids.append(7)
            done = request.num_output_tokens >= request.sampling_params.max_tokens
            if done:
                request.status = RequestStatus.FINISHED_LENGTH
                self._free(request.request_id)
            completion = CompletionOutput(0, "x" * request.num_output_tokens, request.output_token_ids, None, None,
                                          "length" if done else None)
            outputs.append(RequestOutput(request.request_id, None, request.prompt_token_ids, None, [completion],
                                         done, delta_text="x", delta_token_ids=[7]))
        return outputs

    def _free(self, request_id: str) -> None:
        self.scheduler.running.pop(request_id, None)
        self.pool.release(self.pages.pop(request_id, []))


def start(engine: FakeEngine, loop: asyncio.AbstractEventLoop,
          max_queue_len: int | None = None, max_held_requests: int | None = None) -> tuple[EngineThread, list]:
    load_errors: list = []

    def observer(e):
        return RequestObserver(e, ServerMetrics("fake"), ObserverConfig(log_requests=False, log_stats=False))

    thread = EngineThread(lambda: engine, observer, max_queue_len, max_held_requests)
    thread.start(loop, load_errors.append)
    assert thread.loaded.wait(10)
    assert thread.load_error is None, thread.load_error  # never wait on an engine that did not start
    return thread, load_errors


def run(coroutine_factory):
    async def main():
        return await coroutine_factory(asyncio.get_running_loop())
    return asyncio.run(main())


def test_outputs_come_back_in_order_and_the_pages_are_freed():
    engine = FakeEngine()

    async def scenario(loop):
        thread, _ = start(engine, loop)
        outputs: asyncio.Queue = asyncio.Queue()
        await thread.submit("a", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3), 5, outputs)
        got = [await asyncio.wait_for(outputs.get(), 10) for _ in range(3)]
        thread.stop()
        return thread, got

    thread, got = run(scenario)
    assert engine.closed  # the loop closed the engine as it stopped (an L3 cache's pages go down then)
    assert [o.finished for o in got] == [False, False, True]
    assert got[-1].outputs[0].token_ids == [7, 7, 7]
    assert engine.pool.num_used == 0
    metrics = thread.observer.metrics
    assert metrics.generation_tokens._value.get() == 3
    assert metrics.request_success("length")._value.get() == 1


def test_a_refused_request_raises_value_error_in_the_caller():
    async def scenario(loop):
        thread, _ = start(FakeEngine(), loop)
        try:
            with pytest.raises(ValueError, match="refused"):
                await thread.submit("a", {"prompt_token_ids": [0]}, SamplingParams(), 0, asyncio.Queue())
        finally:
            thread.stop()

    run(scenario)


def test_abort_frees_the_pages_and_counts_as_abort():
    engine = FakeEngine()

    async def scenario(loop):
        thread, _ = start(engine, loop)
        outputs: asyncio.Queue = asyncio.Queue()
        await thread.submit("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10 ** 6), 0, outputs)
        await asyncio.wait_for(outputs.get(), 10)
        thread.abort("a")
        thread.abort("never-submitted")
        for _ in range(100):
            if not engine.scheduler.running:
                break
            await asyncio.sleep(0.01)
        thread.stop()
        return thread

    thread = run(scenario)
    assert engine.aborted == ["a"] and engine.pool.num_used == 0
    assert thread.observer.metrics.request_success("abort")._value.get() == 1


def test_a_failing_step_fails_its_requests_and_the_thread_keeps_going():
    engine = FakeEngine(fail_step=True)

    async def scenario(loop):
        thread, _ = start(engine, loop)
        outputs: asyncio.Queue = asyncio.Queue()
        await thread.submit("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=2), 0, outputs)
        error = await asyncio.wait_for(outputs.get(), 10)
        engine.fail_step = False
        again: asyncio.Queue = asyncio.Queue()
        await thread.submit("b", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1), 0, again)
        last = await asyncio.wait_for(again.get(), 10)
        thread.stop()
        return error, last

    error, last = run(scenario)
    assert isinstance(error, EngineError) and "engine failed" in str(error)
    assert "device lost" not in str(error)  # the client reads the error: the log has the exception, not the answer
    assert last.finished and engine.aborted == ["a"]


def test_a_failing_load_is_reported_and_never_ready():
    async def scenario(loop):
        errors: list = []

        def broken():
            raise FileNotFoundError("no such checkpoint: /nope")

        thread = EngineThread(broken, lambda e: None)
        thread.start(loop, errors.append)
        assert thread.loaded.wait(10)
        await asyncio.sleep(0.05)  # the error callback runs on this loop
        return thread, errors

    thread, errors = run(scenario)
    assert not thread.ready and isinstance(thread.load_error, FileNotFoundError)
    assert [str(e) for e in errors] == ["no such checkpoint: /nope"]


def test_beyond_max_queue_len_waiting_requests_a_submit_raises_queue_full():
    engine = FakeEngine()
    engine.scheduler.waiting = ["w1", "w2"]  # two requests wait in the scheduler

    async def scenario(loop):
        thread, _ = start(engine, loop, max_queue_len=2)
        try:
            with pytest.raises(QueueFull, match="2 requests are waiting") as refused:
                await thread.submit("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1), 0, asyncio.Queue())
            engine.scheduler.waiting = ["w1"]
            outputs: asyncio.Queue = asyncio.Queue()
            await thread.submit("b", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1), 0, outputs)
            last = await asyncio.wait_for(outputs.get(), 10)
        finally:
            thread.stop()
        return refused.value, last

    refused, last = run(scenario)
    assert refused.retry_after_s >= 1 and last.finished
    assert "a" not in engine.pages  # the refused request never reached the engine


def test_beyond_max_held_requests_a_submit_raises_queue_full():
    """--max-num-seqs beside --max-batch-size bounds the requests held (running, paused, waiting)."""
    engine = FakeEngine()

    async def scenario(loop):
        thread, _ = start(engine, loop, max_held_requests=1)
        try:
            outputs: asyncio.Queue = asyncio.Queue()
            await thread.submit("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10 ** 6), 0, outputs)
            with pytest.raises(QueueFull, match="1 requests are held"):
                await thread.submit("b", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1), 0, asyncio.Queue())
            thread.abort("a")
        finally:
            thread.stop()

    run(scenario)
    assert "b" not in engine.pages


def test_submissions_beyond_max_queue_len_are_refused_before_the_engine_thread_takes_them():
    engine = FakeEngine()

    async def scenario(loop):
        thread, _ = start(engine, loop, max_queue_len=1)
        thread.stop()  # the engine thread is gone, so submissions stay in the command queue
        first = asyncio.ensure_future(thread.submit("a", {"prompt_token_ids": [1]}, SamplingParams(), 0,
                                                    asyncio.Queue()))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="being queued already"):
            await thread.submit("b", {"prompt_token_ids": [1]}, SamplingParams(), 0, asyncio.Queue())
        first.cancel()

    run(scenario)


def test_swap_metrics_and_ttft_per_priority_class():
    engine = FakeEngine()
    engine.scheduler.swapped_bytes = 0
    engine.kv.num_swapped_requests = 0

    async def scenario(loop):
        thread, _ = start(engine, loop)
        for request_id, priority in (("a", 1000), ("b", 150), ("c", 0)):
            outputs: asyncio.Queue = asyncio.Queue()
            await thread.submit(request_id, {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1), priority,
                                outputs)
            await asyncio.wait_for(outputs.get(), 10)
        engine.scheduler.swapped_bytes = 3 << 20
        engine.kv.num_swapped_requests = 2
        thread.observer.tick(0.0)
        thread.stop()
        return thread.observer.metrics

    metrics = run(scenario)
    assert metrics.swapped_bytes._value.get() == 3 << 20
    assert metrics.num_requests_swapped._value.get() == 2
    text = metrics.render().decode()
    for label in ("1000", "100", "0"):
        assert (f'dflash2_time_to_first_token_by_priority_seconds_count{{model_name="fake",priority_class="{label}"}}'
                f' 1.0') in text


def test_priority_class_rounds_down_to_a_power_of_ten():
    assert [priority_class(p) for p in (0, 1, 9, 10, 100, 150, 999, 1000, 9999, 10000, 65535)] == [
        "0", "1", "1", "10", "100", "100", "100", "1000", "1000", "10000", "10000"]


def test_what_is_alive_at_startup_is_frozen_out_of_garbage_collection():
    """Once the engine is loaded, a full collection must not walk the model's ~300k objects (a pause of the
    whole server): they are frozen before the thread reports ready."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0

    async def scenario(loop):
        thread, _ = start(FakeEngine(), loop)
        frozen = gc.get_freeze_count()
        thread.stop()
        return frozen

    assert run(scenario) > 0


def test_gpu_gauges_are_read_on_their_own_thread_not_the_engine_loop(monkeypatch):
    """The driver calls behind the GPU gauges once stalled the engine loop every second: a GpuSampler thread
    takes them now."""
    from dflash2.server import observer as observer_module

    calls = []

    def reader(device):
        def read():
            calls.append((device, threading.current_thread().name))
            return GpuReading("0", 0.25, 20 << 30, 40.0, 312.5)
        return read

    monkeypatch.setattr(observer_module, "nvml_reader", reader)
    metrics = ServerMetrics("fake")
    engine = SimpleNamespace(model=SimpleNamespace(device=SimpleNamespace(type="cuda")))
    sampler = observer_module.GpuSampler(engine, metrics, interval_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
        sampler.thread.join(5)
    assert calls and calls[0] == (engine.model.device, "dflash2-gpu-sampler")
    assert not sampler.thread.is_alive()
    text = metrics.render().decode()
    assert 'dflash2_gpu_memory_utilization{model_name="fake"} 0.25' in text
    assert 'dflash2_gpu_utilization_perc{model_name="fake"} 40.0' in text
    assert 'dflash2_gpu_utilization{gpu="0",model_name="fake"} 40.0' in text
    assert 'dflash2_gpu_power_draw_watts{gpu="0",model_name="fake"} 312.5' in text
    assert 'dflash2_gpu_memory_used_bytes{gpu="0",model_name="fake"} 2.147483648e+10' in text
    assert sampler.last.utilization_perc == 40.0
