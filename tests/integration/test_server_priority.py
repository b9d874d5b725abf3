"""Priority over HTTP, on a real server with one running slot, a small page pool, host swap space and a queue
bound: an urgent request overtakes queued ones and preempts (swaps) the running one, which resumes with the
same tokens; past --max-queue-len the server answers 503 with Retry-After and keeps serving; the priority
metrics move. Orders of first tokens are compared with each other, never with a clock budget.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.integration.server_process import ServerProcess

pytestmark = pytest.mark.slow

MAX_QUEUE_LEN = 3
PROMPT = "Write a long story about a dragon who learns to cook."


@pytest.fixture(scope="module")
def priority_server():
    server = ServerProcess("--max_num_seqs", "1", "--max-model-len", "256", "--kv_cache_memory", "16MiB",
                           "--swap_space", "0.05", "--max_queue_len", str(MAX_QUEUE_LEN),
                           "--preemption_threshold", "10", "--priority_aging_seconds", "3600",
                           "--disable-log-stats", "--disable-log-requests").start()
    yield server
    server.cleanup()


class Streams:
    """Streamed /generate requests on one event loop, with the monotonic time of each one's first token."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.first_token_at: dict[str, float] = {}
        self.started = {}  # name -> asyncio.Event set at the first token

    async def run(self, client: httpx.AsyncClient, name: str, priority: int, max_tokens: int) -> list[int]:
        self.started.setdefault(name, asyncio.Event())
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "priority": priority, "stream": True}
        tokens: list[int] = []
        async with client.stream("POST", self.url + "/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["token_ids"] and name not in self.first_token_at:
                    self.first_token_at[name] = time.monotonic()
                    self.started[name].set()
                tokens += chunk["token_ids"]
        return tokens

    async def first_token(self, name: str) -> None:
        await asyncio.wait_for(self.started.setdefault(name, asyncio.Event()).wait(), 120)


async def wait_for_metric(server: ServerProcess, name: str, predicate, **labels: str) -> float | None:
    return await asyncio.to_thread(server.wait_for_metric, name, predicate, 120.0, **labels)


def test_an_urgent_request_overtakes_queued_ones_and_the_preempted_one_resumes_unchanged(priority_server):
    server = priority_server
    preemptions_before = server.metric("dflash2_num_preemptions_total")
    streams = Streams(server.url)
    swapped_seen: list[float] = []

    async def watch_swapped(stop: asyncio.Event) -> None:
        while not stop.is_set():
            swapped_seen.append(await asyncio.to_thread(server.metric, "dflash2_num_requests_swapped"))
            await asyncio.sleep(0.02)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            long = asyncio.create_task(streams.run(client, "long", 0, 48))
            await streams.first_token("long")  # it holds the only running slot
            queued = [asyncio.create_task(streams.run(client, f"queued{i}", 0, 4)) for i in range(2)]
            await wait_for_metric(server, "dflash2_num_requests_waiting", lambda v: v == 2)
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_swapped(stop))
            urgent = await streams.run(client, "urgent", 1000, 16)
            results = await asyncio.gather(long, *queued)
            stop.set()
            await watcher
            return results[0], urgent
        
    long_tokens, urgent_tokens = asyncio.run(scenario())
    first = streams.first_token_at
    assert first["urgent"] < first["queued0"] and first["urgent"] < first["queued1"]
    assert len(long_tokens) == 48 and len(urgent_tokens) == 16
    assert server.metric("dflash2_num_preemptions_total") >= preemptions_before + 1
    assert max(swapped_seen) >= 1  # the long request's KV sat in host memory while the urgent one ran
    assert server.wait_for_metric("dflash2_num_requests_swapped", lambda v: v == 0) == 0

    # Swapped out and back in, the long request produced exactly the tokens of an undisturbed run.
    alone = httpx.post(server.url + "/generate", timeout=300, json={
        "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "temperature": 0, "priority": 0}).json()
    assert alone["token_ids"] == long_tokens


def test_swap_and_per_priority_metrics_moved(priority_server):
    server = priority_server
    if not server.metric("dflash2_num_preemptions_total"):
        test_an_urgent_request_overtakes_queued_ones_and_the_preempted_one_resumes_unchanged(server)
    assert server.metric("dflash2_num_swap_outs_total") >= 1
    assert server.metric("dflash2_swapped_bytes_total") >= 1 << 20  # at least one 1 MiB page
    name = "dflash2_time_to_first_token_by_priority_seconds_count"
    assert server.metric(name, priority_class="1000") >= 1
    assert server.metric(name, priority_class="0") >= 3
    assert server.metric(name, priority_class="100") is None  # no such request was sent


def test_past_max_queue_len_the_server_answers_503_with_retry_after_and_keeps_serving(priority_server):
    server = priority_server
    rejected_before = server.metric("dflash2_num_requests_rejected_total")
    streams = Streams(server.url)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            running = asyncio.create_task(streams.run(client, "running", 0, 24))
            await streams.first_token("running")
            queued = [asyncio.create_task(streams.run(client, f"queued{i}", 0, 2)) for i in range(MAX_QUEUE_LEN)]
            await wait_for_metric(server, "dflash2_num_requests_waiting", lambda v: v == MAX_QUEUE_LEN)
            body = {"prompt": PROMPT, "max_tokens": 2, "priority": 1000}
            refused = await asyncio.gather(*(client.post(server.url + "/v1/completions", json=body)
                                             for _ in range(5)))
            served = await asyncio.gather(running, *queued)
            return refused, served

    refused, served = asyncio.run(scenario())
    for response in refused:
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "service_unavailable"
        assert f"--max-queue-len {MAX_QUEUE_LEN}" in error["message"]
    assert [len(tokens) for tokens in served] == [24] + [2] * MAX_QUEUE_LEN
    assert server.metric("dflash2_num_requests_rejected_total") == rejected_before + 5
    again = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": PROMPT, "max_tokens": 2, "priority": 1000})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2


def test_a_requests_prompts_count_against_the_queue_and_are_refused_together(priority_server):
    """One completions request of MAX_QUEUE_LEN + 1 prompts while the one slot runs: the last prompt finds the
    queue full, so the whole request is a 503 and none of its prompts stays queued or holds a page."""
    server = priority_server
    streams = Streams(server.url)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            running = asyncio.create_task(streams.run(client, "running", 0, 16))
            await streams.first_token("running")
            many = await client.post(server.url + "/v1/completions",
                                     json={"prompt": [PROMPT] * (MAX_QUEUE_LEN + 1), "max_tokens": 2})
            return many, await running

    many, tokens = asyncio.run(scenario())
    assert many.status_code == 503 and int(many.headers["Retry-After"]) >= 1, many.text
    assert many.json()["error"]["code"] == "queue_full"
    assert len(tokens) == 16
    for metric in ("dflash2_num_requests_waiting", "dflash2_num_requests_running", "dflash2_kv_cache_used_pages"):
        assert server.wait_for_metric(metric, lambda v: v == 0, 120.0) == 0, metric
    fits = httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": [PROMPT] * MAX_QUEUE_LEN, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == MAX_QUEUE_LEN
