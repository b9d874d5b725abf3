"""The load generator: keep `concurrency` requests in flight (optionally paced at `request_rate`),
for `num_prompts` requests or `duration_s` seconds, while a side task scrapes the server's /metrics.

    dataset (cycled) ─► pacer (Poisson at request_rate, or as fast as slots free up)
                        └─► semaphore(concurrency) ─► client.send() ─► RequestResult ─► report
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, replace
from collections.abc import Coroutine
from typing import Any, TypeVar

from dflash2.bench.client import RequestResult, send, send_raw
from dflash2.bench.dataset import BenchItem

T = TypeVar("T")

_SCRAPE_INTERVAL_S = 1.0
GPU_UTILIZATION_METRIC = "dflash2_gpu_utilization_perc"
GPU_MEMORY_METRIC = "dflash2_gpu_memory_utilization"


@dataclass(frozen=True)
class LoadConfig:
    url: str
    endpoint: str = "/v1/completions"
    concurrency: int = 8
    request_rate: float = float("inf")  # requests per second; inf: send as soon as a slot is free
    num_prompts: int | None = None
    duration_s: float | None = None
    timeout_s: float = 60.0
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    seed: int = 0
    progress: bool = True
    transport: str = "auto"  # "raw" (lean asyncio HTTP/1.1, http:// only), "httpx"; auto: raw for http://
    scrape_metrics: bool = True  # sample the server's GPU gauges while the load runs
    scrape_interval_s: float = _SCRAPE_INTERVAL_S  # ... this often

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "raw", "httpx"):
            raise ValueError(f"transport must be auto, raw or httpx, got {self.transport!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if (self.num_prompts is None) == (self.duration_s is None):
            raise ValueError("give exactly one of --num-prompts and --duration")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration_s: float
    gpu_utilization_samples: list[float]
    gpu_memory_samples: list[float]


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop's event loop: one process reads every stream, and uvloop's loop costs it less
    per event than asyncio's (so its own queueing shows up less as TTFT). What is alive before the run is
    frozen out of garbage collection, so no full collection pauses the client mid-run."""
    import gc

    import uvloop

    gc.collect()
    gc.freeze()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def run_load(config: LoadConfig, items: list[BenchItem]) -> LoadResult:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits) as client:
        scraper = _Scraper(client, config.url, config.scrape_interval_s)
        scrape_task = asyncio.create_task(scraper.run()) if config.scrape_metrics else None
        started = time.perf_counter()
        try:
            results = await _drive(client, config, items, headers)
        finally:
            if scrape_task is not None:
                scrape_task.cancel()
        duration = time.perf_counter() - started
    return LoadResult(results, duration, scraper.gpu_utilization, scraper.gpu_memory)


def run_in_processes(jobs: list[tuple[LoadConfig, list[BenchItem]]], start_in_s: float = 5.0) -> list[LoadResult]:
    """Each (config, items) load in its own (spawned) client process, all starting at the same moment
    (`start_in_s` from now, after every process has imported what it needs): one process per kind of client,
    as when an urgent service and a bulk service share the server, so that one client's event loop busy with
    thousands of bulk tokens a second does not queue the other's first tokens."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start_at = time.time() + start_in_s
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_at, start_at, config, items) for config, items in jobs]
        return [future.result() for future in futures]


def run_per_priority(config: LoadConfig, items: list[BenchItem]) -> LoadResult:
    """config's load (Poisson arrivals) split by priority, each priority from its own client process at its
    share of the rate: independent Poisson streams that add up to arrivals at config.request_rate of the same
    requests. Only the least urgent client scrapes /metrics (if config.scrape_metrics)."""
    if config.num_prompts is None or config.request_rate == float("inf"):
        raise ValueError("a load split by priority needs --num-prompts and a --request-rate")
    sequence = [items[i % len(items)] for i in range(config.num_prompts)]
    priorities = sorted({item.priority for item in sequence})
    jobs = []
    for priority in priorities:
        mine = [item for item in sequence if item.priority == priority]
        jobs.append((replace(config, num_prompts=len(mine), concurrency=len(mine), seed=config.seed + priority,
                             request_rate=config.request_rate * len(mine) / len(sequence),
                             scrape_metrics=config.scrape_metrics and priority == priorities[0], progress=False),
                     mine))
    loads = run_in_processes(jobs)
    return LoadResult([r for load in loads for r in load.results], max(load.duration_s for load in loads),
                      loads[0].gpu_utilization_samples, loads[0].gpu_memory_samples)


def _run_at(start_at: float, config: LoadConfig, items: list[BenchItem]) -> LoadResult:
    import httpx  # noqa: F401 - imported before the start, not inside the timed run
    import tqdm  # noqa: F401
    import uvloop  # noqa: F401

    time.sleep(max(0.0, start_at - time.time()))
    return run_async(run_load(config, items))


async def _drive(client: Any, config: LoadConfig, items: list[BenchItem],
                 headers: dict[str, str]) -> list[RequestResult]:
    from tqdm import tqdm

    rng = random.Random(config.seed)
    slots = asyncio.Semaphore(config.concurrency)
    tasks: list[asyncio.Task] = []
    deadline = time.perf_counter() + config.duration_s if config.duration_s is not None else None
    bar = tqdm(total=config.num_prompts, unit="req", disable=not config.progress, leave=False)

    url = config.url.rstrip("/")
    raw = config.transport == "raw" or (config.transport == "auto" and url.startswith("http://"))

    async def one(item: BenchItem) -> RequestResult:
        try:
            if raw:
                sending = send_raw(url, config.endpoint, item, config.model, config.ignore_eos, headers)
            else:
                sending = send(client, url, config.endpoint, item, config.model, config.ignore_eos, headers)
            return await asyncio.wait_for(sending, config.timeout_s)
        except asyncio.TimeoutError:
            return RequestResult(item.priority, error=f"timed out after {config.timeout_s:g} s")
        finally:
            slots.release()
            bar.update(1)

    for count, item in enumerate(itertools.cycle(items)):
        if config.num_prompts is not None and count >= config.num_prompts:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            break
        if config.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(config.request_rate))
        await slots.acquire()
        if deadline is not None and time.perf_counter() >= deadline:
            slots.release()
            break
        tasks.append(asyncio.create_task(one(item)))
    results = list(await asyncio.gather(*tasks))
    bar.close()
    return results


class _Scraper:
    """Samples the server's GPU gauges every interval_s; leaves the lists empty when it has none (CPU)."""

    def __init__(self, client: Any, url: str, interval_s: float = _SCRAPE_INTERVAL_S) -> None:
        self.client = client
        self.interval_s = interval_s
        self.url = url.rstrip("/") + "/metrics"
        self.gpu_utilization: list[float] = []
        self.gpu_memory: list[float] = []

    async def run(self) -> None:
        while True:
            await self.scrape()
            await asyncio.sleep(self.interval_s)

    async def scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            response = await self.client.get(self.url)
            if response.status_code != 200:
                return
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name == GPU_UTILIZATION_METRIC:
                        self.gpu_utilization.append(sample.value)
                    elif sample.name == GPU_MEMORY_METRIC:
                        self.gpu_memory.append(sample.value)
        except Exception:  # noqa: BLE001 - metrics are best effort; the load run goes on without them
            return
