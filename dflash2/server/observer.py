"""RequestObserver: per-request timings, Prometheus metrics and JSON logs, fed by the engine thread.

One request's clock (time.monotonic):

    submitted ──queue── first scheduled ──prefill── first token ──decode── last token (finished)
    |<─────────────── TTFT ──────────────────────────>|
    |<──────────────────────────────── e2e ─────────────────────────────────────────>|

Everything here runs on the engine thread, right after the step that produced the outputs, except the GPU
readings (device memory, busy percent): a GpuSampler thread takes them through NVML once a second (read on the
engine thread, through CUDA and torch.cuda.utilization, they stalled it by a few milliseconds each time).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash2.request import Request, RequestOutput
from dflash2.server.metrics import GpuReading, ServerMetrics

request_logger = logging.getLogger("dflash2.requests")  # one JSON object per line, set up by the launcher
logger = logging.getLogger("dflash2.server")

_GAUGE_INTERVAL_S = 1.0
_KV_USAGE_WINDOW_S = 60.0  # dflash2_avg_kv_cache_utilization averages the pool's use over this long


@dataclass
class Tracked:
    """A request the engine thread has accepted and not yet finished."""

    request: Request
    outputs: asyncio.Queue
    submitted_at: float
    priority: int | None = None  # as the client sent it (the engine's is flipped by low_priority_values_first)
    first_token_at: float | None = None
    last_token_at: float | None = None
    timing: StreamTiming | None = None  # the HTTP side's own times (event loop thread)


@dataclass
class StreamTiming:
    """When the HTTP side received a request and first wrote tokens of it (time.monotonic; written on the event
    loop thread, read by the engine thread's request log): with the engine's own times they split a client's
    TTFT into HTTP in, engine, and HTTP out."""

    received_at: float | None = None  # the ASGI app saw the request
    first_sent_at: float | None = None  # the first text of tokens went to the response stream (a token whose
    # text is held back, half a character or a possible stop string, is not sent yet: the client sees nothing)


@dataclass(frozen=True)
class ObserverConfig:
    log_requests: bool = True
    log_tokens: bool = False
    log_stats: bool = True
    stats_interval_s: float = 10.0


class RequestObserver:
    def __init__(self, engine: Any, metrics: ServerMetrics, config: ObserverConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.config = config
        self.model_name = metrics.model_name
        self._first_model = next(iter(engine.models))  # its metrics and log lines go under the server's name
        self._page_bytes = engine.pool.page_bytes
        # per loaded model, (name, id): the engine's counts already counted (an unloaded model's entry goes)
        self._seen: dict[tuple[str, int], dict[str, int]] = {}
        self._labels: set[str] = set()  # the models whose gauges are set
        self._kv_usage: collections.deque[tuple[float, float]] = collections.deque()  # (when, used fraction)
        self._seen_evictions = 0
        self._seen_tiers: dict[tuple[str, str], int] = {}
        self.gpu_sampler = GpuSampler(engine, metrics) if _is_cuda(engine) else None
        metrics.gc_pauses.install()
        self._gauge_tick = (time.monotonic(), 0)  # (when, evictions then)
        self._stats_tick = (time.monotonic(), 0, 0)  # (when, prompt tokens then, generation tokens then)
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        metrics.kv_cache_total_pages.set(engine.pool.num_pages)
        metrics.engine_torch_threads.set(_torch_threads())  # (built on the engine's own thread and process)
        self._update_gauges()

    def label(self, model: str | None) -> str:
        """The model_name a model's metrics and log lines carry: the server's name for the first model."""
        return self.model_name if model is None or model == self._first_model else model

    # -- per request ---------------------------------------------------------------------------------
    def on_output(self, tracked: Tracked, output: RequestOutput, now: float) -> None:
        num_new = len(output.delta_token_ids)
        if num_new == 0:
            return
        m = self.metrics.model(self.label(tracked.request.model))
        if tracked.first_token_at is None:
            tracked.first_token_at = now
            m.time_to_first_token.observe(now - tracked.submitted_at)
            m.time_to_first_token_by_priority(_client_priority(tracked)).observe(now - tracked.submitted_at)
            self._num_prompt_tokens += tracked.request.num_prompt_tokens
            m.prompt_tokens.inc(tracked.request.num_prompt_tokens)
        else:
            m.inter_token_latency.observe(now - (tracked.last_token_at or now))
        latency_ms = 1000.0 * (now - (tracked.last_token_at or tracked.submitted_at))
        tracked.last_token_at = now
        self._num_generation_tokens += num_new
        m.generation_tokens.inc(num_new)
        if self.config.log_tokens:
            for token_id in output.delta_token_ids:
                self._log_token(tracked, token_id, latency_ms)

    def on_finished(self, tracked: Tracked, finish_reason: str, now: float) -> None:
        request = tracked.request
        m = self.metrics.model(self.label(request.model))
        m.request_success(finish_reason).inc()
        m.e2e_request_latency.observe(now - tracked.submitted_at)
        scheduled = _first_scheduled(request)
        if scheduled is not None:
            m.request_queue_time.observe(max(0.0, scheduled - tracked.submitted_at))
            if tracked.first_token_at is not None:
                m.request_prefill_time.observe(max(0.0, tracked.first_token_at - scheduled))
        if tracked.first_token_at is not None:
            m.request_decode_time.observe(now - tracked.first_token_at)
        if self.config.log_requests:
            request_logger.info(json.dumps(self._request_record(tracked, finish_reason, now)))

    def _request_record(self, tracked: Tracked, finish_reason: str, now: float) -> dict[str, Any]:
        request = tracked.request
        first_token = tracked.first_token_at
        scheduled = _first_scheduled(request)
        num_output = request.num_output_tokens
        return {
            "event": "request_finished", "time": round(time.time(), 3), "request_id": request.request_id,
            "model": self.label(request.model), "priority": _client_priority(tracked), "finish_reason": finish_reason,
            "prompt_tokens": request.num_prompt_tokens, "completion_tokens": num_output,
            "cached_tokens": request.num_cached_tokens, "num_preemptions": request.num_preemptions,
            "queue_time_ms": _ms(scheduled - tracked.submitted_at) if scheduled is not None else None,
            "ttft_ms": _ms(first_token - tracked.submitted_at) if first_token is not None else None,
            "tpot_ms": _ms((now - first_token) / (num_output - 1)) if first_token and num_output > 1 else None,
            "e2e_ms": _ms(now - tracked.submitted_at),
            **_http_times(tracked),
        }

    def _log_token(self, tracked: Tracked, token_id: int, latency_ms: float) -> None:
        request = tracked.request
        served = self.engine.models.get(request.model)
        if served is None:
            return  # unloaded meanwhile (force)
        tokenizer = served.tokenizer
        text = tokenizer.decode([token_id]) if tokenizer is not None else None
        num_pages = -(-request.num_tokens // served.kv.tokens_per_page)
        request_logger.info(json.dumps({
            "event": "token", "req_id": request.request_id, "token_id": token_id, "token_text": text,
            "latency_ms": round(latency_ms, 3), "kv_cache_size_bytes": num_pages * self._page_bytes,
            "priority": _client_priority(tracked), "model": self.label(request.model),
            "quant_config": quant_bits(served), **self._gpu_sm_util()}, ensure_ascii=False))

    def _gpu_sm_util(self) -> dict[str, float]:
        """{"gpu_sm_util": busy percent} from the GPU sampler's latest NVML reading, where there is one."""
        reading = self.gpu_sampler.last if self.gpu_sampler is not None else None
        if reading is None or reading.utilization_perc is None:
            return {}
        return {"gpu_sm_util": reading.utilization_perc}

    # -- per step and per tick -----------------------------------------------------------------------
    def on_step(self, engine: Any, now: float, step_seconds: float | None = None) -> None:
        self.metrics.scheduler_latency.observe(getattr(engine, "last_plan_seconds", 0.0) * 1e6)
        if step_seconds is not None:
            self.metrics.step_duration.observe(step_seconds)
            self.metrics.step_launch.observe(getattr(engine, "last_launch_seconds", 0.0))
            self.metrics.step_finish.observe(getattr(engine, "last_finish_seconds", 0.0))
        self._update_gauges()

    def close(self) -> None:
        """Stop what the observer started (the GPU sampler thread, the garbage collection callback)."""
        self.metrics.gc_pauses.remove()
        if self.gpu_sampler is not None:
            self.gpu_sampler.stop()

    def tick(self, now: float) -> None:
        """Called on every turn of the engine loop (at least every half second when idle)."""
        self._update_gauges()
        when, evictions = self._gauge_tick
        if now - when >= _GAUGE_INTERVAL_S:
            self.metrics.cache_eviction_rate.set((self._seen_evictions - evictions) / (now - when))
            self._gauge_tick = (now, self._seen_evictions)
            self._kv_usage.append((now, self.engine.pool.num_used / self.engine.pool.num_pages))
            while self._kv_usage[0][0] < now - _KV_USAGE_WINDOW_S:
                self._kv_usage.popleft()
            self.metrics.avg_kv_cache_utilization.set(sum(u for _, u in self._kv_usage) / len(self._kv_usage))
        if self.config.log_stats and now - self._stats_tick[0] >= self.config.stats_interval_s:
            self._log_stats(now)

    def _update_gauges(self) -> None:
        engine, metrics = self.engine, self.metrics
        pool = engine.pool
        metrics.kv_cache_used_pages.set(pool.num_used)
        metrics.kv_cache_usage_perc.set(pool.num_used / pool.num_pages)
        _inc_by_delta(metrics.cache_evictions, pool.num_evictions - self._seen_evictions)
        self._seen_evictions = pool.num_evictions
        self._update_tiers()
        labels = set()
        for name, served in engine.models.items():
            label = self.label(name)
            labels.add(label)
            self._update_model(served, metrics.model(label))
        if self._labels - labels:  # unloaded
            for gone in self._labels - labels:
                metrics.drop_model_gauges(gone)
            self._seen = {key: seen for key, seen in self._seen.items() if key[0] in engine.models}
        self._labels = labels

    def _update_tiers(self) -> None:
        """The tiers' pool-wide counters (bytes each way, evictions) and the disk tier's gauges."""
        engine, metrics = self.engine, self.metrics
        page_bytes = engine.pool.page_bytes
        counts = {("evictions", "device"): engine.pool.num_evictions}
        if engine.host_pool is not None:
            host = engine.host_pool
            counts.update({("evictions", "host"): host.num_evictions, ("written", "host"): host.num_stored * page_bytes,
                           ("read", "host"): host.num_touched * page_bytes})
        disk = engine.disk_tier
        if disk is not None:
            store = disk.store
            counts.update({("evictions", "disk"): store.num_evictions, ("written", "disk"): store.bytes_written,
                           ("read", "disk"): store.bytes_read, ("corrupt", "disk"): store.num_corrupt})
            metrics.l3_cache_writes_disabled.set(int(store.writes_disabled))
            if store.avg_read_latency_s is not None:
                metrics.l3_cache_avg_latency_us.set(store.avg_read_latency_s * 1e6)
            queries = sum(served.kv.num_prefix_queries for served in engine.models.values())
            if queries:
                metrics.l3_cache_hit_ratio.set(
                    sum(served.kv.num_prefix_hits_disk for served in engine.models.values()) / queries)
        for key, count in counts.items():
            kind, tier = key
            target = {"evictions": metrics.tier_evictions, "written": metrics.tier_written,
                      "read": metrics.tier_read}.get(kind)
            counter = target(tier) if target is not None else metrics.l3_cache_corrupt_files
            _inc_by_delta(counter, count - self._seen_tiers.get(key, 0))
            self._seen_tiers[key] = count

    def _update_model(self, served: Any, m: Any) -> None:
        """One model's gauges, and its counters by what the engine counted since the last update."""
        scheduler, kv = served.scheduler, served.kv
        m.num_requests_running.set(len(scheduler.running))
        m.num_requests_waiting.set(len(scheduler.waiting))
        m.num_requests_swapped.set(kv.num_swapped_requests)
        m.kv_pages_used.set(kv.num_used)
        m.kv_pages_cached.set(kv.num_cached)
        seen = self._seen.setdefault((served.name, id(served)), {})  # loaded again: counts from zero
        counts = {"num_preemptions": scheduler.num_preemptions, "num_swap_outs": scheduler.num_swap_outs,
                  "num_spills": kv.num_spills, "swapped_bytes": scheduler.swapped_bytes,
                  "prefix_cache_queries": kv.num_prefix_queries,
                  "prefix_cache_hits": kv.num_prefix_hits}
        for attribute, count in counts.items():
            _inc_by_delta(getattr(m, attribute), count - seen.get(attribute, 0))
            seen[attribute] = count
        below = kv.num_prefix_hits_host + kv.num_prefix_hits_disk
        tier_hits = {"device": kv.num_prefix_hits - below, "host": kv.num_prefix_hits_host,
                     "disk": kv.num_prefix_hits_disk}
        for tier, hits in tier_hits.items():
            _inc_by_delta(m.kv_cache_tier_hits[tier], hits - seen.get(tier, 0))
            seen[tier] = hits
            if kv.num_prefix_queries:
                m.kv_cache_hit_ratio[tier].set(hits / kv.num_prefix_queries)

    def _log_stats(self, now: float) -> None:
        when, prompt, generation = self._stats_tick
        elapsed = max(now - when, 1e-9)
        prompt_rate = (self._num_prompt_tokens - prompt) / elapsed
        generation_rate = (self._num_generation_tokens - generation) / elapsed
        self._stats_tick = (now, self._num_prompt_tokens, self._num_generation_tokens)
        running = self.engine.num_running
        waiting = self.engine.num_waiting
        if prompt_rate or generation_rate or running or waiting:
            logger.info("stats: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV pages %.1f%%",
                        prompt_rate, generation_rate, running, waiting,
                        100.0 * self.engine.pool.num_used / self.engine.pool.num_pages)


def quant_bits(served: Any) -> list[int]:
    """The per-token log's quant_config: [qk_bits, v_bits, o_bits, proj_bits] of the model's weights (q, k and v
    are one fused group; a float model: its dtype's bits)."""
    quant = served.model.quant if served.model is not None else None
    if quant is None:
        bits = served.model.dtype.itemsize * 8 if served.model is not None else 16
        return [bits] * 4
    return [quant.qkv, quant.qkv, quant.o_proj, quant.ffn]


def _client_priority(tracked: Tracked) -> int:
    return tracked.priority if tracked.priority is not None else tracked.request.priority


def _first_scheduled(request: Request) -> float | None:
    return getattr(request, "first_scheduled_time", None)  # set by Engine.step on the first step that ran it


def _inc_by_delta(counter: Any, delta: int) -> None:
    if delta > 0:
        counter.inc(delta)


def _ms(seconds: float) -> float:
    return round(1000.0 * seconds, 3)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _is_cuda(engine: Any) -> bool:
    return getattr(getattr(engine.model, "device", None), "type", "cpu") == "cuda"


class GpuSampler:
    """Sets the GPU gauges every `interval_s` from a daemon thread of its own (a CUDA engine only), through NVML
    (initialized once; its calls release the GIL and take no CUDA context lock). Without pynvml it reads device
    memory through CUDA every FALLBACK_INTERVAL_S instead, and no busy percent."""

    FALLBACK_INTERVAL_S = 10.0

    def __init__(self, engine: Any, metrics: ServerMetrics, interval_s: float = _GAUGE_INTERVAL_S) -> None:
        self.device = engine.model.device
        self.metrics = metrics
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.last: GpuReading | None = None  # the latest reading (the per-token log's gpu_sm_util)
        self.thread = threading.Thread(target=self._run, name="dflash2-gpu-sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            read, interval_s = nvml_reader(self.device), self.interval_s
        except Exception:  # noqa: BLE001 - no pynvml, or NVML cannot start
            read = lambda: cuda_memory_reading(self.device)  # noqa: E731
            interval_s = max(self.interval_s, self.FALLBACK_INTERVAL_S)
        while True:  # a reading at once (the first token log lines carry gpu_sm_util), then every interval
            try:
                self.last = read()
                self.metrics.set_gpu(self.last)
            except Exception:  # noqa: BLE001 - a gauge reading must never take the server down
                logger.exception("reading the GPU gauges failed; they stop updating")
                return
            if self.stopped.wait(interval_s):
                return

    def stop(self) -> None:
        self.stopped.set()


def nvml_reader(device: Any) -> Callable[[], GpuReading]:
    """A function reading this CUDA device through NVML: memory, busy percent, power draw."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    # torch's own mapping of a CUDA device to its NVML index (it honours CUDA_VISIBLE_DEVICES)
    index = torch.cuda._get_nvml_device_index(device)
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read() -> GpuReading:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
        except pynvml.NVMLError:
            power = None
        return GpuReading(str(index), memory.used / memory.total, int(memory.used),
                          float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu), power)
    return read


def cuda_memory_reading(device: Any) -> GpuReading:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return GpuReading(str(device.index or 0), 1.0 - free / total, int(total - free))


def _http_times(tracked: Tracked) -> dict[str, float]:
    """received -> handed to the engine thread, and the engine's first token -> written to the stream; and the
    two HTTP-side instants themselves (time.monotonic, seconds: the host-wide clock a client on this machine
    can set its own times beside, as benchmarks/priority.py does)."""
    timing, times = tracked.timing, {}
    if timing is None:
        return times
    if timing.received_at is not None:
        times["http_in_ms"] = _ms(tracked.submitted_at - timing.received_at)
        times["received_monotonic"] = round(timing.received_at, 6)
    if timing.first_sent_at is not None and tracked.first_token_at is not None:
        times["http_out_ms"] = _ms(timing.first_sent_at - tracked.first_token_at)
        times["first_sent_monotonic"] = round(timing.first_sent_at, 6)
    return times
