"""Prometheus metrics, labelled with `model_name`: vLLM's set under the `dflash2_` prefix, plus our own.

`dflash2_time_to_first_token_by_priority_seconds` also carries `priority_class`: the request's priority as
the client sent it, rounded down to a power of ten ("0", "1", "10", "100", "1000", "10000"), so the
bench's classes 0 / 100 / 1000 are their own labels and a client cannot make more than six series.

Every metric lives in the server's own CollectorRegistry (so two servers in one process do not collide).
The engine thread writes them (prometheus_client is thread-safe); /metrics and --metrics-port read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from dflash2.server.gc_pauses import GcPauses

disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0)
_STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                 5.0)
_SCHEDULER_BUCKETS_US = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000)


# Per model (labelled with the model's name when several are served): requests, tokens, latencies, its KV.
PER_MODEL = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "prompt_tokens", "generation_tokens", "num_preemptions", "num_swap_outs", "num_spills", "swapped_bytes",
             "prefix_cache_queries", "prefix_cache_hits", "time_to_first_token", "inter_token_latency",
             "e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time")


TIERS = ("device", "host", "disk")  # the prefix cache's tiers: the `tier` label


@dataclass(frozen=True)
class GpuReading:
    """One sample of one GPU (observer.GpuSampler): NVML's, or CUDA's memory alone without NVML."""

    gpu: str  # its index, the `gpu` label
    memory_fraction: float
    memory_used_bytes: int
    utilization_perc: float | None = None
    power_watts: float | None = None


class ServerMetrics:
    """The metric families. Server-wide ones (steps, the pool as a whole, the GPU) are bound to the server's model
    name; the per-model ones (PER_MODEL) come from model(name), and as attributes for the server's own name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._families: dict[str, Any] = {}
        self._models: dict[str, ModelMetrics] = {}

        def family(kind: type, name: str, doc: str, extra_labels: tuple[str, ...] = (), **kwargs):
            """A metric labelled model_name (+ extra_labels), in this server's registry."""
            return kind(name, doc, ["model_name", *extra_labels], registry=self.registry, **kwargs)

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return family(Histogram, name, doc, buckets=buckets).labels(model_name)

        def per_model(attribute: str, kind: type, name: str, doc: str, **kwargs) -> None:
            self._families[attribute] = family(kind, name, doc, **kwargs)

        per_model("num_requests_running", Gauge, "dflash2_num_requests_running", "Requests in the running set")
        per_model("num_requests_waiting", Gauge, "dflash2_num_requests_waiting", "Requests waiting (incl. preempted)")
        self.kv_cache_usage_perc = gauge("dflash2_kv_cache_usage_perc", "Fraction of KV pages owned by requests")
        self.kv_cache_used_pages = gauge("dflash2_kv_cache_used_pages", "KV pages owned by requests")
        self.kv_cache_total_pages = gauge("dflash2_kv_cache_total_pages", "KV pages in the pool")
        self.kv_cache_model_pages = family(Gauge, "dflash2_kv_cache_model_pages",
                                           "KV pages of one model of the pool: used (owned by its requests) or "
                                           "cached (its prefix cache)", ("state",))
        self._kv_cache_hit_ratio = family(Gauge, "dflash2_kv_cache_hit_ratio",
                                          "Prompt tokens served from one tier of the prefix cache / prompt tokens "
                                          "(cumulative; the tiers add up to the whole hit ratio)", ("tier",))
        self._kv_cache_tier_hits = family(Counter, "dflash2_kv_cache_tier_hit_tokens",
                                          "Prompt tokens served from one tier of the prefix cache", ("tier",))
        tier_pages = "KV bytes {} one tier: host (pages copied down to / up from host memory), disk (files)"
        self._kv_tier_bytes_written = family(Counter, "dflash2_kv_tier_bytes_written", tier_pages.format("into"),
                                             ("tier",))
        self._kv_tier_bytes_read = family(Counter, "dflash2_kv_tier_bytes_read", tier_pages.format("out of"),
                                          ("tier",))
        self._kv_tier_evictions = family(Counter, "dflash2_kv_tier_evictions",
                                         "Cached pages dropped from one tier for room (device, host, disk)",
                                         ("tier",))
        self.l3_cache_hit_ratio = gauge("dflash2_l3_cache_hit_ratio",
                                        "Prompt tokens read from the disk tier / prompt tokens (cumulative)")
        self.l3_cache_avg_latency_us = gauge("dflash2_l3_cache_avg_latency_us",
                                             "Mean time to read and check one page file of the disk tier")
        self.l3_cache_corrupt_files = counter("dflash2_l3_cache_corrupt_files",
                                              "Disk tier files that failed their check (removed, read as misses)")
        self.l3_cache_writes_disabled = gauge("dflash2_l3_cache_writes_disabled",
                                              "1 once an I/O error turned the disk tier's writing off")
        self.cache_eviction_rate = gauge("dflash2_cache_eviction_rate",
                                         "Cached pages evicted per second over the last stats interval")
        self.engine_torch_threads = gauge("dflash2_engine_torch_threads",
                                          "torch intra-op threads of the process that runs the engine (--num-threads)")
        # No child until a value is known, so that on the CPU these have no sample at all.
        self._gpu_memory_utilization = family(Gauge, "dflash2_gpu_memory_utilization",
                                              "Fraction of the GPU's memory in use (absent on CPU)")
        self._gpu_utilization_perc = family(Gauge, "dflash2_gpu_utilization_perc",
                                            "GPU busy percentage from NVML (absent on CPU or without NVML)")
        self._gpu_memory_used = family(Gauge, "dflash2_gpu_memory_used_bytes", "Device memory in use, per GPU",
                                       ("gpu",))
        self._gpu_power = family(Gauge, "dflash2_gpu_power_draw_watts", "Power draw from NVML, per GPU", ("gpu",))
        self._gpu_utilization = family(Gauge, "dflash2_gpu_utilization",
                                       "GPU busy percentage from NVML, per GPU (0-100)", ("gpu",))
        self.avg_kv_cache_utilization = gauge("dflash2_avg_kv_cache_utilization",
                                              "Mean fraction of KV pages owned by requests over the last minute")
        per_model("prompt_tokens", Counter, "dflash2_prompt_tokens", "Prompt tokens of admitted requests")
        per_model("generation_tokens", Counter, "dflash2_generation_tokens", "Generated tokens")
        per_model("num_preemptions", Counter, "dflash2_num_preemptions", "Requests preempted")
        per_model("num_swap_outs", Counter, "dflash2_num_swap_outs", "Preempted requests whose KV went to host memory")
        per_model("num_spills", Counter, "dflash2_num_spills",
                  "Swapped requests spilled to the disk tier when host memory was full of swapped pages")
        per_model("swapped_bytes", Counter, "dflash2_swapped_bytes", "Bytes of KV copied to host memory by preemption")
        per_model("num_requests_swapped", Gauge, "dflash2_num_requests_swapped",
                  "Paused requests whose KV is in host memory now")
        self.num_requests_rejected = counter("dflash2_num_requests_rejected",
                                             "Requests refused with 503 because --max-queue-len were waiting")
        self.cache_evictions = counter("dflash2_cache_evictions", "Cached pages evicted")
        per_model("prefix_cache_queries", Counter, "dflash2_prefix_cache_queries", "Prompt tokens looked up in the cache")
        per_model("prefix_cache_hits", Counter, "dflash2_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.streaming_success = counter("dflash2_streaming_success", "Streams that ended normally")
        self.streaming_timeout = counter("dflash2_streaming_timeout",
                                         "Streams ended because no token came within --streaming-timeout-ms")
        self._request_success = family(Counter, "dflash2_request_success", "Finished requests by finish reason",
                                       ("finished_reason",))
        per_model("time_to_first_token", Histogram, "dflash2_time_to_first_token_seconds", "Time to first token",
                  buckets=_TTFT_BUCKETS)
        self._ttft_by_priority = family(Histogram, "dflash2_time_to_first_token_by_priority_seconds",
                                        "Time to first token per priority class (priority rounded down to a "
                                        "power of ten)", ("priority_class",), buckets=_TTFT_BUCKETS)
        per_model("inter_token_latency", Histogram, "dflash2_inter_token_latency_seconds", "Time between tokens",
                  buckets=_ITL_BUCKETS)
        per_model("e2e_request_latency", Histogram, "dflash2_e2e_request_latency_seconds", "Arrival to last token",
                  buckets=_REQUEST_BUCKETS)
        per_model("request_queue_time", Histogram, "dflash2_request_queue_time_seconds", "Arrival to first scheduled",
                  buckets=_REQUEST_BUCKETS)
        per_model("request_prefill_time", Histogram, "dflash2_request_prefill_time_seconds",
                  "First scheduled to first token", buckets=_REQUEST_BUCKETS)
        per_model("request_decode_time", Histogram, "dflash2_request_decode_time_seconds", "First token to last token",
                  buckets=_REQUEST_BUCKETS)
        self.step_duration = histogram("dflash2_step_duration_seconds",
                                       "Wall time of one Engine.step() (plan, run, commit) on the engine thread",
                                       _STEP_BUCKETS)
        self.step_launch = histogram("dflash2_step_launch_seconds",
                                     "Part of a step spent building its inputs and launching its kernels", _STEP_BUCKETS)
        self.step_finish = histogram("dflash2_step_finish_seconds",
                                     "Part of a step spent waiting for a step's results (the device) and committing "
                                     "them", _STEP_BUCKETS)
        self.scheduler_latency = histogram("dflash2_scheduler_latency_microseconds",
                                           "Time Scheduler.plan() takes per step", _SCHEDULER_BUCKETS_US)
        self.gc_pauses = GcPauses(model_name)  # dflash2_gc_pause_seconds; records once install()ed
        self.registry.register(self.gc_pauses)
        own = self.model(model_name)
        for attribute in PER_MODEL:  # the server's own name: as before several models could be served
            setattr(self, attribute, getattr(own, attribute))
        self.request_success = own.request_success
        self.time_to_first_token_by_priority = own.time_to_first_token_by_priority

    def model(self, name: str) -> ModelMetrics:
        """The per-model metrics of the model labelled `name` (made on first use)."""
        metrics = self._models.get(name)
        if metrics is None:
            metrics = self._models[name] = ModelMetrics(name, self._families, self._request_success,
                                                        self._ttft_by_priority, self.kv_cache_model_pages,
                                                        self._kv_cache_hit_ratio, self._kv_cache_tier_hits)
        return metrics

    def drop_model_gauges(self, name: str) -> None:
        """An unloaded model's gauges go (its counters and histograms stay: what it served is history)."""
        for attribute in PER_MODEL:
            family = self._families[attribute]
            if isinstance(family, Gauge):
                family.remove(name)
        for state in ("used", "cached"):
            self.kv_cache_model_pages.remove(name, state)
        for tier in TIERS:
            self._kv_cache_hit_ratio.remove(name, tier)
        self._models.pop(name, None)  # made again (with its gauges) if a model of that name comes back

    def tier_written(self, tier: str) -> Counter:
        return self._kv_tier_bytes_written.labels(self.model_name, tier)

    def tier_read(self, tier: str) -> Counter:
        return self._kv_tier_bytes_read.labels(self.model_name, tier)

    def tier_evictions(self, tier: str) -> Counter:
        return self._kv_tier_evictions.labels(self.model_name, tier)

    def set_gpu(self, reading: GpuReading) -> None:
        """One GPU's gauges; a value the reading lacks (no NVML) keeps no sample."""
        name, gpu = self.model_name, reading.gpu
        self._gpu_memory_utilization.labels(name).set(reading.memory_fraction)
        self._gpu_memory_used.labels(name, gpu).set(reading.memory_used_bytes)
        if reading.utilization_perc is not None:
            self._gpu_utilization_perc.labels(name).set(reading.utilization_perc)
            self._gpu_utilization.labels(name, gpu).set(reading.utilization_perc)
        if reading.power_watts is not None:
            self._gpu_power.labels(name, gpu).set(reading.power_watts)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's children of the per-model families (attributes named as in PER_MODEL)."""

    def __init__(self, name: str, families: dict[str, Any], request_success: Counter, ttft_by_priority: Histogram,
                 kv_pages: Gauge, hit_ratio: Gauge, tier_hits: Counter) -> None:
        self.name = name
        for attribute in PER_MODEL:
            setattr(self, attribute, families[attribute].labels(name))
        self.kv_pages_used = kv_pages.labels(name, "used")
        self.kv_pages_cached = kv_pages.labels(name, "cached")
        self.kv_cache_hit_ratio = {tier: hit_ratio.labels(name, tier) for tier in TIERS}
        self.kv_cache_tier_hits = {tier: tier_hits.labels(name, tier) for tier in TIERS}
        self._request_success = request_success
        self._ttft_by_priority = ttft_by_priority
        for reason in ("stop", "length", "abort"):
            request_success.labels(name, reason)

    def request_success(self, finished_reason: str) -> Counter:
        return self._request_success.labels(self.name, finished_reason)

    def time_to_first_token_by_priority(self, priority: int) -> Histogram:
        return self._ttft_by_priority.labels(self.name, priority_class(priority))


def priority_class(priority: int) -> str:
    """The `priority_class` label: the priority rounded down to a power of ten ("0" for 0)."""
    if priority <= 0:
        return "0"
    return str(10 ** (len(str(int(priority))) - 1))
