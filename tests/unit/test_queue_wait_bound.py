"""The wait bound (--max-queue-wait): a request whose line drains slower than the bound is refused with 503's
QueueFull and leaves nothing behind; an urgent request is not refused for the less urgent line behind it."""
from __future__ import annotations

import asyncio
import time

import pytest

from dflash2.engine.queues import WaitingQueue
from dflash2.request import Request
from dflash2.sampling_params import SamplingParams
from dflash2.server.engine_messages import QueueFull
from dflash2.server.engine_thread import EngineThread
from dflash2.server.metrics import ServerMetrics
from dflash2.server.observer import ObserverConfig, RequestObserver
from tests.unit.test_engine_thread import FakeEngine, run


def test_num_ahead_counts_the_requests_before_a_request_in_line():
    line = WaitingQueue()
    requests = [Request(f"r{i}", [1], SamplingParams(), priority=p) for i, p in enumerate([0, 5, 0, 10])]
    for arrival, request in enumerate(requests):
        line.add(request, arrival)
    assert [line.num_ahead(r) for r in requests] == [2, 1, 3, 0]  # 10 first, then 5, then the 0s by arrival
    line.remove(requests[3])
    assert line.num_ahead(requests[0]) == 1 and line.num_ahead(requests[3]) is None


class LineEngine(FakeEngine):
    """FakeEngine whose new requests find `ahead` requests before them in line (so it is busy all along)."""

    def __init__(self, ahead: int) -> None:
        super().__init__()
        self.ahead = ahead

    def has_unfinished(self) -> bool:
        return True

    def num_waiting_ahead(self, request: Request) -> int:
        return self.ahead


def submit_once(engine: LineEngine, finishes_in_last_30_s: int) -> tuple[BaseException | None, EngineThread]:
    """Submit one request to a loop with a 10 s wait bound whose engine finished this many requests in the
    last 30 busy seconds."""
    async def scenario(loop):
        thread = EngineThread(lambda: engine, lambda e: RequestObserver(e, ServerMetrics("fake"), ObserverConfig(
            log_requests=False, log_stats=False)), max_queue_wait_s=10.0)
        thread.start(loop, lambda error: None)
        assert thread.loaded.wait(10) and thread.load_error is None
        now = time.monotonic()
        thread._busy_since = now - 30.0
        for i in range(finishes_in_last_30_s):
            thread._finishes.add(now - 1.0 - i)
        try:
            await thread.submit("new", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10 ** 6), 0,
                                asyncio.Queue())
            thread.abort("new")
            return None, thread
        except QueueFull as refused:
            return refused, thread
        finally:
            thread.stop()

    return run(scenario)


@pytest.mark.parametrize("ahead, finishes, refused", [(2, 3, True), (1, 3, False), (0, 0, False), (40, 150, False)])
def test_a_request_expected_to_wait_past_the_bound_is_refused(ahead, finishes, refused):
    engine = LineEngine(ahead)
    error, thread = submit_once(engine, finishes)
    # 3 finishes in 30 s: 10 s a request; 2 ahead wait 20 s > 10 (refused), 1 ahead waits 10 s (taken);
    # none ahead is never refused; 40 ahead at 5 a second wait 8 s (taken)
    assert (error is not None) == refused
    if refused:
        assert isinstance(error, QueueFull) and "2 requests are ahead of this one, about 20 s" in str(error)
        assert error.retry_after_s == 20 and engine.aborted == ["new"]
    assert engine.pool.num_used == 0  # refused or taken and aborted: no page left behind


def test_the_engine_counts_the_requests_ahead_in_a_models_line(tmp_path):
    from dflash2 import LLM
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    with LLM(str(tmp_path), max_num_seqs=1, max_model_len=64) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=2)
        first, second = (engine.add_request({"prompt_token_ids": [1, 2]}, params, 0, f"r{i}") for i in range(2))
        urgent = engine.add_request({"prompt_token_ids": [3]}, params, 10, "urgent")
        assert [engine.num_waiting_ahead(r) for r in (first, second, urgent)] == [1, 2, 0]
        engine.abort("r0")
        assert engine.num_waiting_ahead(second) == 1 and engine.num_waiting_ahead(first) is None
