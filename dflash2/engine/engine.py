"""Engine: owns the requests and runs the step loop   plan -> launch -> commit.

    add_request() ─► Scheduler.waiting
    step():  Scheduler.plan() ─► StepPlan ─► ModelRunner.launch() ─► PendingStep ─► collect ─► _commit()
             _commit writes the sampled tokens, checks stop conditions, frees finished requests' pages and
             returns one RequestOutput per request that produced something.

Overlapped (the default on GPU): step N+1 is planned and launched before step N is committed.

    host:    plan N+1 | launch N+1 | collect+commit N | plan N+2 | launch N+2 | collect+commit N+1 ...
    device:  ...... step N ......  | ............ step N+1 ...........| ......... step N+2 ....

A step that samples the first token of a request that outranks a running request, and that no request in the
step outranks, is committed in the same call, right after its launch, so that token is not held back for the
next step's launch (the next step then starts from an idle device; same-priority batches never take this path,
nor does a less urgent first token while a more urgent request runs: the device would idle for it).

Several models (EngineConfig.models): each has its own scheduler, KV manager and runner (ServedModel) on one
page pool; a step runs one model's batch. The model that steps next is the one with the most urgent work
(effective priority of its waiting or running requests), ties going to the one that stepped least recently;
a model with work that another model's steps passed over `max_model_skip_steps` times goes first (no model starves).
Preemption crosses models (Scheduler.peers). Models load and unload while the others serve (load_model,
unload_model).

Step N's sampled tokens are not known on the host when N+1 is planned, so each request gets a
placeholder token (resolved on the device from the runner's future-token buffer, and on the host at
commit). A request that hits max_tokens is marked finish_pending so it is not scheduled again; one that
stops on EOS or a stop string costs one wasted row in the next step.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash2.config import CacheConfig, DeviceDefaults, ModelArchConfig, SchedulerConfig
from dflash2.engine.detokenizer import IncrementalDetokenizer
from dflash2.engine.kv.disk_store import DiskStore
from dflash2.engine.kv.disk_tier import DiskTier, fingerprint
from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.layout import KVLayout, resolve_kv_dtype
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.plan import StepPlan
from dflash2.engine.graphs import graph_batch_sizes, mixed_graph_shapes
from dflash2.engine.guided import GrammarCompilers
from dflash2.engine.held_requests import HeldRequests, prompt_computed
from dflash2.engine.memory import gpu_pool_bytes, profile_model_memory
from dflash2.engine.runner import ModelRunner, PendingStep, RunnerOptions, StepResult
from dflash2.engine.sampler import make_generator
from dflash2.engine.scheduler import Scheduler
from dflash2.engine.served_model import ModelSpec, PreparedModel, ServedModel
from dflash2.engine.storage import PoolStorage
from dflash2.engine.step_trace import StepTrace
from dflash2.loading.model_loader import LoadedModel, load_model
from dflash2.parallel.config import ParallelConfig
from dflash2.request import CompletionOutput, Request, RequestOutput, RequestStatus, TokenView, check_priority
from dflash2.sampling_params import MAX_PRIORITY, SamplingParams, check_against_vocab


logger = logging.getLogger("dflash2")

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or preset name (dummy); None: the bundled model
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False  # never capture CUDA graphs
    # steps with prefill chunks of up to this many tokens also replay CUDA graphs (0: decode-only graphs)
    cuda_graph_max_prefill_tokens: int = 2048
    overlap: bool | None = None  # overlapped scheduling; None: on for CUDA, off on the CPU
    low_priority_values_first: bool = False  # vLLM's convention: a smaller number is more urgent
    # a streamed request's output comes every this many tokens (its first and last at once): fewer outputs
    # to build and to write under load (vLLM's --stream-interval)
    stream_interval: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # several models on one pool (empty: the one model above); each spec's unset options take the ones above
    models: tuple[ModelSpec, ...] = ()
    # a model with work steps at least once every this many steps, whatever the others' priorities
    max_model_skip_steps: int = 8
    # tensor / pipeline parallelism: the ranks one model is split over and what runs them (dflash2/parallel/)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_model_skip_steps < 1:
            raise ValueError(f"max_model_skip_steps must be >= 1, got {self.max_model_skip_steps}")

    def model_specs(self) -> tuple[ModelSpec, ...]:
        return self.models or (ModelSpec(model=self.model, tokenizer=self.tokenizer),)

def _device_scheduler_config(config: SchedulerConfig, device: torch.device, model_name: str = "") -> SchedulerConfig:
    """The scheduler's sizes the user left unset, chosen for the device; logged, with where each came from."""
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    chosen = config.with_device_defaults(device.type, memory)
    logger.info("batch sizes for %s%s: %s", device.type, f" ({model_name})" if model_name else "", ", ".join(
        f"{name} {getattr(chosen, name)} ({'given' if getattr(config, name) is not None else 'device default'})"
        for name in DeviceDefaults.FIELDS))
    return chosen


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


PREFILL_RATE_MIN_TOKENS = 256  # steps with fewer prompt tokens tell little about the prefill rate


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = None  # the other ranks of a parallel engine (parallel/executor.py); this is rank 0
        if config.parallel.uses_executor:
            from dflash2.parallel.executor import Executor

            self.executor = Executor(config)
        self.device = device = self.executor.device if self.executor is not None else resolve_device(config.device)
        cache = config.cache
        specs = config.model_specs()
        self.models: dict[str, ServedModel] = {}
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held = HeldRequests()  # taken, not yet scheduled (held_requests.py)
        self._grammars = GrammarCompilers()  # structured output (guided.py)
        self._in_flight: tuple[ServedModel, StepPlan, PendingStep] | None = None
        self.trace: StepTrace | None = None
        self.disk_tier: DiskTier | None = None
        self._last_result_time: float | None = None  # when the latest step's results were in (prefill rate)
        self._admissions = itertools.count()  # shared by the models' schedulers (cross-model victim order)
        loaded = []
        try:
            for spec in specs:  # every model's weights first: the pool takes what they leave
                loaded.append(self._load(spec, single=len(specs) == 1))
            names = [prepared.name for prepared in loaded]
            if len(set(names)) != len(names):
                raise ValueError(f"two models have the same name ({', '.join(names)}); name them with NAME=PATH")
            num_pages = self._num_pages(loaded)
        except BaseException:
            loaded.clear()
            if self.executor is not None:
                self.executor.shutdown()
            _release_device_memory()
            raise
        num_host_pages = cache.swap_space_bytes // cache.page_bytes
        # a parallel rank's pages hold its part of each token (its KV heads and layers): same tokens, fewer bytes
        page_bytes = cache.page_bytes if self.executor is None else self.executor.page_bytes(loaded[0].layout)
        self.storage = PoolStorage(num_pages, page_bytes, num_host_pages, device)
        self.pool = PagePool(num_pages, cache.page_bytes)
        self.host_pool = HostPagePool(num_host_pages) if num_host_pages else None
        # the host pages are also the L2 tier: cached pages the device evicts are copied down, not dropped
        self.pool.keep_evicted = self.host_pool is not None and cache.enable_prefix_caching
        self.disk_tier = self._disk_tier() if self.pool.keep_evicted and cache.l3_cache_path else None
        try:
            for prepared in loaded:
                self._serve(prepared)
        except BaseException:
            loaded.clear()
            self.close()
            raise
        loaded.clear()
        self.overlap = config.overlap if config.overlap is not None else device.type == "cuda"
        self.trace = StepTrace.from_env(device)  # one JSON line a step, if DFLASH2_STEP_TRACE names a file
        self._num_added = 0  # requests added so far
        self._num_steps = 0
        self.last_model: str | None = None  # the model of the latest step launched
        self._failures: list[tuple[str, str]] = []  # requests ended by a failure of their own (take_failures)
        self._ids = itertools.count()
        # where the latest step's host time went (server metrics read them): Scheduler.plan(), building inputs
        # and launching the kernels, and waiting for a step's results (the device) and committing them
        self.last_plan_seconds = self.last_launch_seconds = self.last_finish_seconds = 0.0

    # -- the models --------------------------------------------------------------------------------
    def _load(self, spec: ModelSpec, single: bool) -> PreparedModel:
        """Load one model's weights and work out its sizes (nothing of the pool yet)."""
        config, device = self.config, self.device
        sched = config.scheduler if spec.max_num_seqs is None else \
            dataclasses.replace(config.scheduler, max_num_seqs=spec.max_num_seqs)
        load_format = spec.load_format or config.load_format
        if spec.quantization is not None and load_format != "dummy":
            raise ValueError("quantization applies to dummy weights only (load_format 'dummy'); convert a "
                             "checkpoint with `dflash2 convert` instead")
        load = load_model if self.executor is None else self.executor.load_shard  # (every rank its part)
        model = load(spec.model, load_format, spec.dtype or config.dtype, device, config.scheduler.max_model_len,
                     config.seed, spec.tokenizer or config.tokenizer, quantization=spec.quant_config())
        name = (spec.served_name() if not single or spec.name is not None else None) or model.name
        model.name = name
        scheduler_config = _device_scheduler_config(sched, device, name if not single else "")
        max_model_len = self._max_model_len(model.arch)
        checkpoint_kv = model.quant.kv_cache_dtype if model.quant is not None else None
        kv_dtype = resolve_kv_dtype(spec.kv_cache_dtype or config.cache.kv_cache_dtype, model.dtype, checkpoint_kv)
        layout = KVLayout.for_model(model.arch, kv_dtype, config.cache.page_bytes,
                                    head_major=config.cache.kv_layout == "head_major")
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        options = RunnerOptions(attention_backend=backend, seed=config.seed,
                                max_slots=scheduler_config.max_num_seqs, max_model_len=max_model_len,
                                enforce_eager=config.enforce_eager,
                                num_host_pages=config.cache.swap_space_bytes // config.cache.page_bytes)
        return PreparedModel(name, spec, model, scheduler_config, max_model_len, layout, options)

    def _serve(self, prepared: PreparedModel) -> ServedModel:
        """Put a loaded model on the pool: its limits, KV manager, scheduler (peers of the others), runner, graphs."""
        name, spec, model, layout = prepared.name, prepared.spec, prepared.model, prepared.layout
        scheduler_config, max_model_len = prepared.scheduler_config, prepared.max_model_len
        capacity = self.pool.num_pages * layout.tokens_per_page
        if capacity < max_model_len:
            raise ValueError(f"max_model_len {max_model_len} of {name} does not fit: the KV cache holds {capacity} "
                             f"of its tokens ({self.pool.num_pages} pages of {layout.tokens_per_page}); lower "
                             f"max_model_len or give the cache more memory")
        ceiling = None if spec.max_pool_share is None else max(1, int(spec.max_pool_share * self.pool.num_pages))
        self.pool.set_limits(name, int(spec.min_pool_share * self.pool.num_pages), ceiling)
        kv = KVManager(self.pool, layout.tokens_per_page, name, self.config.cache.enable_prefix_caching,
                       max_slots=scheduler_config.max_num_seqs, host_pool=self.host_pool)
        if self.disk_tier is not None:
            kv.disk = self.disk_tier
            self.disk_tier.add_model(name, _fingerprint(prepared))
        scheduler = Scheduler(scheduler_config, kv, admissions=self._admissions)
        runner = (ModelRunner if self.executor is None else self.executor.runner)(
            model, layout, self.pool.num_pages, prepared.options, storage=self.storage)
        eos_token_ids = set(model.arch.eos_token_ids)
        if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
            eos_token_ids.add(model.tokenizer.eos_token_id)
        runner.eos_token_ids = tuple(sorted(eos_token_ids))
        if self.device.type == "cuda" and not self.config.enforce_eager and self.executor is None:
            runner.capture_graphs(graph_batch_sizes(scheduler_config.max_num_seqs),
                                  mixed_graph_shapes(scheduler_config.max_num_seqs,
                                                     self._graph_prefill_tokens(scheduler_config)))
        served = ServedModel(name, spec, model, scheduler_config, max_model_len, layout, kv, scheduler, runner,
                             eos_token_ids)
        self.models[name] = served
        self._link_peers()
        logger.info("model %s: %d layers, weights %s, KV %s, %d tokens a page (pool: %d pages, %d of its tokens), "
                    "max_model_len %d", name, model.arch.num_layers, served.describe()["weights"], layout.dtype,
                    layout.tokens_per_page, self.pool.num_pages, self.pool.num_pages * layout.tokens_per_page,
                    max_model_len)
        return served

    def _disk_tier(self) -> DiskTier:
        cache = self.config.cache
        size = cache.l3_cache_size_bytes
        if size is None:
            if not os.path.isdir(cache.l3_cache_path):
                raise ValueError(f"the L3 cache directory {cache.l3_cache_path} does not exist")
            size = int(shutil.disk_usage(cache.l3_cache_path).free * CacheConfig.L3_DEFAULT_FREE_SHARE)
            logger.info("L3 cache size: %.1f GiB (%d%% of the free space in %s)", size / (1 << 30),
                        int(CacheConfig.L3_DEFAULT_FREE_SHARE * 100), cache.l3_cache_path)
        store = DiskStore(cache.l3_cache_path, size, cache.page_bytes)
        return DiskTier(store, self.host_pool, self.storage.host_pages, self.storage.copies_done)

    def _link_peers(self) -> None:
        for served in self.models.values():
            served.scheduler.peers = [other.scheduler for other in self.models.values() if other is not served]

    def load_model(self, spec: ModelSpec) -> ServedModel:
        """Load another model while the others serve; its KV comes from the same pool. ValueError (nothing
        changed) for a duplicate name, a model that cannot load, or not enough memory."""
        return self.attach_model(self.prepare_model(spec))

    def prepare_model(self, spec: ModelSpec) -> PreparedModel:
        """The slow half of load_model: the weights, read while the engine keeps stepping (thread-safe: it
        touches neither the pool nor the other models). ValueError if the model cannot load."""
        name = spec.served_name()
        if name is not None and name in self.models:
            raise ValueError(f"a model named {name!r} is already loaded")
        if self.executor is not None:
            raise ValueError(f"loading a model while serving is not supported with {self.config.parallel.describe()}")
        try:
            return self._load(spec, single=False)
        except torch.cuda.OutOfMemoryError:
            _release_device_memory()
            raise _no_room_for(spec.model) from None
        except OSError as e:  # no such file, unreadable, not a model
            raise ValueError(f"cannot load {spec.model!r}: {e}") from None

    def attach_model(self, prepared: PreparedModel) -> ServedModel:
        """The quick half of load_model, between steps: the prepared model joins the pool and the scheduling."""
        name = prepared.name
        try:
            if name in self.models:
                raise ValueError(f"a model named {name!r} is already loaded")
            return self._serve(prepared)
        except torch.cuda.OutOfMemoryError:
            raise _no_room_for(name) from None
        finally:
            if name not in self.models:
                self.pool.forget(name)
                del prepared
                _release_device_memory()

    def unload_model(self, name: str, force: bool = False) -> None:
        """Free a model's weights, graphs and pages. Its requests must be done, or `force` aborts them."""
        served = self.served(name)
        pending = [r for r in self.requests.values() if r.model == name]
        if pending and not force:
            raise ValueError(f"model {name!r} still has {len(pending)} requests; let them finish or force")
        for request in pending:
            self.abort(request.request_id)
        if self._in_flight is not None and self._in_flight[0] is served:
            self._finish_in_flight()  # its outputs are for nobody now
        del self.models[name]
        self._grammars.forget(name)
        self._link_peers()
        served.runner.close()
        self.pool.forget(name)
        if self.host_pool is not None:
            self.host_pool.forget(name)
        served.model = served.runner = None
        _release_device_memory()
        logger.info("model %s unloaded", name)

    def served(self, name: str | None = None) -> ServedModel:
        """The model named `name`; None: the only one loaded. ValueError if there is no such model."""
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            if not self.models:
                raise ValueError("no model is loaded")
            raise ValueError(f"several models are loaded ({', '.join(self.models)}): name one")
        served = self.models.get(name)
        if served is None:
            raise ValueError(f"no model named {name!r} is loaded; loaded: {', '.join(self.models) or 'none'}")
        return served

    # the first model's parts: what a single-model engine's callers read
    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    @property
    def model(self) -> LoadedModel:
        return self.default.model

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.default.tokenizer

    @property
    def kv(self) -> KVManager:
        return self.default.kv

    @property
    def scheduler(self) -> Scheduler:
        return self.default.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.default.runner

    @property
    def max_model_len(self) -> int:
        return self.default.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.default.eos_token_ids

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.default.scheduler_config

    @property
    def num_waiting(self) -> int:
        return sum(len(served.scheduler.waiting) for served in self.models.values()) + len(self._held)

    @property
    def num_preemptions(self) -> int:
        return sum(served.scheduler.num_preemptions for served in self.models.values())

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None, priority: int = 0,
                    request_id: str | None = None, model: str | None = None,
                    shares_prompt_with: str | None = None) -> Request:
        """Validate and queue one request for `model` (None: the only model loaded); raises ValueError saying
        what is wrong with it. One request draws one sample (parallel_sampling.py splits n). `shares_prompt_with`:
        the id of a request with the same prompt (another sample of it): this one waits until that one's prompt
        KV is computed, then takes its pages from the prefix cache."""
        params = params or SamplingParams()
        served = self.served(model)
        if served.closing:
            raise ValueError(f"model {served.name!r} is being unloaded")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(served, prompt)
        self._validate(served, token_ids, params)
        check_priority(priority)  # before the flip below, so the message names what the client sent
        if self.config.low_priority_values_first:
            priority = MAX_PRIORITY - priority
        request = Request(request_id, token_ids, params, priority=priority, prompt=prompt_text, model=served.name)
        if params.structured_outputs is not None:
            request.guided = self._grammars.state_for(served.name, served.tokenizer, served.model.arch.vocab_size,
                                                      served.eos_token_ids, params.structured_outputs,
                                                      request.token_ids)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.device)
        self.requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(served.tokenizer, token_ids, params)
        leader = self.requests.get(shares_prompt_with) if shares_prompt_with is not None else None
        if leader is not None and leader.prompt_token_ids == token_ids:
            self._held.hold(request, prompt_computed(leader))
        else:
            served.scheduler.add(request)
        self._num_added += 1
        return request

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        self._held.drop(request_id)
        if request is not None and not request.status.finished:
            self.models[request.model].scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._detokenizers.pop(request_id, None)

    def close(self) -> None:
        """Free what the engine holds on the device and the host (page pool, CUDA graphs, pinned buffers, the
        models) and end its requests; idempotent. Dropping the last reference to the engine does the same."""
        if getattr(self, "storage", None) is None:
            return
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None
        if self.disk_tier is not None:
            self._persist_tiers()
            self.disk_tier.close()
            self.disk_tier = None
        for served in self.models.values():
            served.runner.close()
            served.model = served.runner = None
        self.models.clear()
        self.storage = None
        if self.executor is not None:
            self.executor.shutdown()
        if self.trace is not None:
            self.trace.file.close()
            self.trace = None
        gc.collect()  # whatever still points at device tensors through a cycle
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:  # cuBLAS's per-stream workspaces (the engine's streams are gone)
                clear_workspaces()  # (only here: a captured graph of a model still loaded may use them)
        _release_device_memory()

    def _persist_tiers(self) -> None:
        """Write the prefix cache's pages on the device and in host memory down to disk, so that a new server
        starts warm (at most l3_cache_flush_timeout_s; what is left then is lost)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.disk_tier.poll()
        pages = self.pool.cached_pages() + self.host_pool.cached_pages()
        timeout = self.config.cache.l3_flush_timeout_s
        done = self.disk_tier.persist([(self._page_bytes_on_host(where, page), content_hash, owner)
                                       for where, page, content_hash, owner in pages], timeout)
        logger.info("L3 cache: %d pages written down at shutdown%s", len(pages),
                    "" if done else f" (not all within {timeout:g} s)")

    def _page_bytes_on_host(self, where: str, page: int) -> torch.Tensor:
        if where == "host":
            return self.storage.host_pages[page]
        return self.storage.device_pages[page].cpu()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "storage", None) is not None:
            self.close()

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or bool(self._held) or \
            any(m.scheduler.has_unfinished() for m in self.models.values())

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: plan and launch a step, and commit the previous one (overlapped) or this one."""
        self.last_plan_seconds = self.last_launch_seconds = self.last_finish_seconds = 0.0
        outputs: list[RequestOutput] = []
        started = time.perf_counter()
        if self.disk_tier is not None:
            self.disk_tier.poll()  # pages read from or written to disk since the last step
        if self._held:
            for request in self._held.release():
                self.models[request.model].scheduler.add(request)
        served, plan = self._plan_next()
        self.last_plan_seconds = time.perf_counter() - started
        if not plan and self.disk_tier is not None and self.disk_tier.num_loading and self._in_flight is None:
            time.sleep(0.0005)  # only requests waiting for disk reads: do not spin the host meanwhile
        if plan and self._in_flight is not None and self._needs_token_values(plan):
            outputs += self._finish_in_flight()  # penalties read the real tokens, not placeholders
        launched = None
        urgent_first_token = False
        if plan:
            pending = self._launch(served, plan)
            urgent_first_token = self._urgent_first_token(*self._step_priorities(plan))
            if not self.overlap:
                self._in_flight = (served, plan, pending)
                return outputs + self._finish_in_flight(placeholders=False)
            self._add_placeholders(served, pending)
            launched = (served, plan, pending)
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
        self._in_flight = launched
        if urgent_first_token:  # deliver it now rather than after the next step's launch (an eager step's
            outputs += self._finish_in_flight()  # host time): the device idles for one launch, only here
        return outputs

    def _plan_next(self) -> tuple[ServedModel | None, StepPlan]:
        """The plan of the model that steps next (an empty plan if no model has anything to run now)."""
        self._num_steps += 1
        if len(self.models) == 1:
            served = self.default
            return served, served.scheduler.plan()
        order = self._step_order()
        chosen, plan = None, StepPlan()
        for served in order:
            plan = served.scheduler.plan()
            if plan:
                chosen = served
                break
        for served in order:  # the models with work that did not step wait one step longer
            served.skipped_steps = 0 if served is chosen else served.skipped_steps + 1
        if chosen is not None:
            chosen.last_step = self._num_steps
        return chosen, plan

    def _step_order(self) -> list[ServedModel]:
        """The models with work, in the order they get to plan this step: one skipped for max_model_skip_steps
        steps while it had work first (the longest skipped first), then by their most urgent request's effective
        priority, then the one that stepped least recently (equal priorities take turns)."""
        now = time.monotonic()
        bound = self.config.max_model_skip_steps
        keyed = []
        for served in self.models.values():
            top = served.scheduler.top_priority(now)
            if top is None:
                served.skipped_steps = 0  # no work: nothing to starve
                continue
            starving = served.skipped_steps >= bound
            keyed.append(((not starving, -served.skipped_steps if starving else 0, -top, served.last_step), served))
        keyed.sort(key=lambda item: item[0])
        return [served for _, served in keyed]

    def _launch(self, served: ServedModel, plan: StepPlan) -> PendingStep:
        self.last_model = served.name
        self._mark_scheduled(plan)
        trace = None
        if self.trace:
            _, top, first_token_top = self._step_priorities(plan)
            trace = self.trace.begin(plan, top, first_token_top, self.last_plan_seconds)
        launch_started = time.perf_counter()
        pending = served.runner.launch(plan, self.requests)
        if self.disk_tier is not None:  # after the launch queued its copies down to host pages
            self.disk_tier.write_ahead()
        self.last_launch_seconds = time.perf_counter() - launch_started
        if trace is not None:
            self.trace.launched(trace, self.last_launch_seconds)
            pending.trace = trace
        return pending

    def _step_priorities(self, plan: StepPlan) -> tuple[int | None, int | None, int | None]:
        """The lowest and highest priority among the step's requests, and the highest among those whose first
        token it samples (None: no such request). One pass over the chunks, on every step: a step whose first
        token outranks another request in it is committed at once (step())."""
        lowest = top = first_token_top = None
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            priority = request.priority
            if lowest is None or priority < lowest:
                lowest = priority
            if top is None or priority > top:
                top = priority
            if chunk.sample and request.num_output_tokens == 0 \
                    and (first_token_top is None or priority > first_token_top):
                first_token_top = priority
        return lowest, top, first_token_top

    def _urgent_first_token(self, lowest: int | None, top: int | None, first_token_top: int | None) -> bool:
        """Whether the step samples the first token of a request that no request in it outranks and that
        outranks some running request (in the step or waiting out of it): that step is committed at once."""
        if first_token_top is None or first_token_top < top:
            return False
        if first_token_top > lowest:
            return True
        return any(r.priority < first_token_top for served in self.models.values()
                   for r in served.scheduler.running.values())

    def _mark_scheduled(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is not None and request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def _needs_token_values(self, plan: StepPlan) -> bool:
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if chunk.sample and request is not None and request.sampling_params.has_penalty:
                return True
        return False

    def _add_placeholders(self, served: ServedModel, pending: PendingStep) -> None:
        for request_id, placeholder in zip(pending.sample_ids, pending.placeholders):
            request = self.requests[request_id]
            request.token_ids.append(placeholder)
            max_tokens = request.sampling_params.max_tokens
            if (max_tokens is not None and request.num_output_tokens >= max_tokens) \
                    or request.num_tokens >= served.max_model_len:
                request.finish_pending = True

    def _finish_in_flight(self, placeholders: bool = True) -> list[RequestOutput]:
        """Wait for the step in flight and commit it (`placeholders`: its tokens replace the placeholders it
        appended at launch, overlapped; else they are appended)."""
        started = time.perf_counter()
        served, plan, pending = self._in_flight
        self._in_flight = None
        result = served.runner.collect(pending)
        if self.disk_tier is not None:
            self._measure_prefill(plan)
        outputs = self._commit(served, plan, result, pending.placeholders if placeholders else None)
        elapsed = time.perf_counter() - started
        self.last_finish_seconds += elapsed
        if pending.trace is not None:
            self.trace.finished(pending.trace, elapsed)
        return outputs

    def _measure_prefill(self, plan: StepPlan) -> None:
        """The prefill rate the disk tier weighs a read against: prompt tokens a second of steps that are mostly
        prefill (a step's time: from the previous step's results to its own, the device busy in between)."""
        now = time.perf_counter()
        last, self._last_result_time = self._last_result_time, now
        tokens = sum(chunk.num_tokens for chunk in plan.chunks if not chunk.is_decode)
        if last is None or tokens < PREFILL_RATE_MIN_TOKENS or now <= last:
            return
        rate = tokens / (now - last)
        known = self.disk_tier.prefill_tokens_per_s
        self.disk_tier.prefill_tokens_per_s = rate if known is None else 0.8 * known + 0.2 * rate

    def _commit(self, served: ServedModel, plan: StepPlan, result: StepResult,
                placeholders: list[int] | None) -> list[RequestOutput]:
        outputs = []
        for request_id, (start, entries) in result.prompt_logprobs.items():
            if request_id in self.requests:
                self._record_prompt_logprobs(served.tokenizer, self.requests[request_id], start, entries)
        for index, (request_id, token_id) in enumerate(result.sampled.items()):
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue  # finished or aborted while this step was in flight
            if request_id in result.failed:
                self._fail(served, request, result.failed[request_id])
                continue
            num_outputs = self._place_token(request, token_id, placeholders[index] if placeholders else None)
            self._record_logprobs(served.tokenizer, request, token_id, result.logprobs.get(request_id))
            status = self._check_stop(served, request, token_id, num_outputs)
            if status is None:
                streamed = request.num_streamed_tokens
                if not request.sampling_params.final_only and (
                        streamed == 0 or num_outputs - streamed >= self.config.stream_interval):
                    outputs.append(self._output(request, self._unstreamed(request, token_id, num_outputs),
                                                num_outputs))
                continue
            served.kv.commit(request)  # the pages this step filled stay reusable (on_step_done skips it now)
            served.scheduler.finish(request, status)
            outputs.append(self._output(request, self._unstreamed(request, token_id, num_outputs), num_outputs))
            del self.requests[request_id]
            del self._detokenizers[request_id]
        served.scheduler.on_step_done(plan)
        return outputs

    def _fail(self, served: ServedModel, request: Request, reason: str) -> None:
        """End one request whose step part raised (its neighbours go on); take_failures() reports it."""
        served.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        del self.requests[request.request_id]
        del self._detokenizers[request.request_id]
        self._failures.append((request.request_id, reason))

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of the requests ended by a failure since the last call: no output comes for
        them; the caller tells their clients."""
        failures, self._failures = self._failures, []
        return failures

    @staticmethod
    def _unstreamed(request: Request, token_id: int, num_outputs: int) -> list[int]:
        """The output tokens up to num_outputs not yet in an output (the latest one is token_id); marks them
        streamed."""
        streamed, request.num_streamed_tokens = request.num_streamed_tokens, num_outputs
        if streamed == num_outputs - 1:
            return [token_id]
        first = request.num_prompt_tokens
        return request.token_ids[first + streamed:first + num_outputs]

    @staticmethod
    def _place_token(request: Request, token_id: int, placeholder: int | None) -> int:
        """Put the sampled token in place (replacing its placeholder); returns the output count up to it."""
        if placeholder is None:
            request.token_ids.append(token_id)
            return request.num_output_tokens
        index = len(request.token_ids) - 1
        while request.token_ids[index] != placeholder:
            index -= 1
        request.token_ids[index] = token_id
        return index + 1 - request.num_prompt_tokens

    def _check_stop(self, served: ServedModel, request: Request, token_id: int,
                    num_outputs: int) -> RequestStatus | None:
        params = request.sampling_params
        detok = self._detokenizers[request.request_id]
        past_min = num_outputs >= params.min_tokens
        stop_string = detok.add_token(token_id, check_stop=past_min)
        if past_min:
            if token_id in served.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_prompt_tokens + num_outputs >= served.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, new_token_ids: list[int], num_outputs: int) -> RequestOutput:
        finished = request.status.finished
        detok = self._detokenizers[request.request_id]
        first = request.num_prompt_tokens
        completion = CompletionOutput(
            index=0, text=detok.text,
            token_ids=list(request.token_ids[first:first + num_outputs]) if finished
            else TokenView(request.token_ids, first, first + num_outputs),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs, finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, request.prompt_logprobs,
                             [completion], finished, request.num_cached_tokens,
                             delta_text=detok.take_delta(finished), delta_token_ids=new_token_ids)

    def _record_logprobs(self, tokenizer: Any, request: Request, token_id: int, entries: dict | None) -> None:
        if request.logprobs is None or entries is None:
            return
        _decode_entries(tokenizer, entries)
        request.logprobs.append(entries)
        request.cumulative_logprob += entries[token_id].logprob

    def _record_prompt_logprobs(self, tokenizer: Any, request: Request, start: int, entries: list[dict]) -> None:
        assert request.prompt_logprobs is not None
        for offset, entry in enumerate(entries):
            if start + offset == len(request.prompt_logprobs):  # skip positions recorded before a preemption
                _decode_entries(tokenizer, entry)
                request.prompt_logprobs.append(entry)

    # -- set-up helpers ----------------------------------------------------------------------------
    def _tokenize(self, served: ServedModel, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(served, prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if served.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
            return prompt, served.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(served, prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _check_token_ids(served: ServedModel, token_ids: Sequence[Any]) -> list[int]:
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = served.model.arch.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab})")
        return list(token_ids)

    def _validate(self, served: ServedModel, token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        check_against_vocab(params, served.model.arch.vocab_size)
        if len(token_ids) >= served.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {served.max_model_len} "
                             f"(at least one token must be left to generate)")
        total = min(served.max_model_len, len(token_ids) + (params.max_tokens or served.max_model_len))
        limit = self.pool.num_pages
        if served.spec.max_pool_share is not None:
            limit = max(1, int(served.spec.max_pool_share * self.pool.num_pages))
        if served.kv.num_pages_for(total) > limit:
            raise ValueError(f"the request needs up to {total} tokens of KV cache, more than the whole pool holds "
                             f"for this model ({limit * served.kv.tokens_per_page})")

    def _max_model_len(self, arch: ModelArchConfig) -> int:
        limit = self.config.scheduler.max_model_len or arch.max_position_embeddings
        if self.config.scheduler.max_model_len and limit > arch.max_position_embeddings:
            raise ValueError(f"max_model_len {limit} exceeds the model's max_position_embeddings "
                             f"{arch.max_position_embeddings}")
        if arch.sliding_window and arch.sliding_window < limit:
            logger.warning("sliding-window attention is not implemented; max_model_len capped to the window %d",
                           arch.sliding_window)
            limit = arch.sliding_window
        return limit

    def _graph_prefill_tokens(self, scheduler_config: SchedulerConfig) -> int:
        """The largest prefill a graph is captured for: 0 (decode-only graphs) when graphs are off (a parallel
        engine runs eager for now)."""
        if self.config.enforce_eager or self.executor is not None:
            return 0
        return min(self.config.cuda_graph_max_prefill_tokens, scheduler_config.max_num_batched_tokens)

    def _num_pages(self, loaded: list[PreparedModel]) -> int:
        """The pool's size: --kv-cache-memory, else on the GPU what the utilization leaves after every model's
        weights and run-time needs, else on the CPU what every model's sequences can use (1 GiB at most each)."""
        cache = self.config.cache
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda" and self.executor is not None:  # every rank profiles; the fewest pages
                p = loaded[0]
                return self.executor.gpu_num_pages(p.model, p.layout, p.options,
                                                   p.scheduler_config.max_num_batched_tokens,
                                                   p.scheduler_config.max_num_seqs, self._graph_prefill_tokens(
                                                       p.scheduler_config) + p.scheduler_config.max_num_seqs,
                                                   cache.gpu_memory_utilization)
            if self.device.type == "cuda":
                needs = [profile_model_memory(p.model, p.layout, p.options, p.scheduler_config.max_num_batched_tokens,
                                              p.scheduler_config.max_num_seqs,
                                              graph_tokens=self._graph_prefill_tokens(p.scheduler_config)
                                              + p.scheduler_config.max_num_seqs)
                         for p in loaded]
                budget = gpu_pool_bytes(self.device, needs, cache.gpu_memory_utilization)
            else:
                budget = 0
                for p in loaded:
                    needed_pages = -(-p.max_model_len * p.scheduler_config.max_num_seqs // p.layout.tokens_per_page)
                    budget += min(CacheConfig.CPU_DEFAULT_KV_BYTES, needed_pages * p.layout.page_bytes)
        num_pages = budget // cache.page_bytes
        if num_pages < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no page of {cache.page_bytes} bytes")
        return num_pages


def _decode_entries(tokenizer: Any, entries: dict) -> None:
    """Each logprob entry's token text (the model's tokenizer; none: left unset)."""
    if tokenizer is not None:
        for token_id, entry in entries.items():
            entry.decoded_token = tokenizer.convert_ids_to_tokens(token_id)


def _no_room_for(model: str | None) -> ValueError:
    return ValueError(f"not enough device memory to load {model!r} beside the models loaded; unload one or start "
                      f"with a smaller --gpu-memory-utilization / --kv-cache-memory")


def _fingerprint(prepared: PreparedModel) -> str:
    """The L3 files' fingerprint of a model: its name, weights (path, size and time of the file or directory),
    formats and KV layout."""
    spec, path = prepared.spec, prepared.spec.model
    stat = os.stat(path) if path is not None and os.path.exists(path) else None
    return fingerprint(prepared.name, path, stat and (stat.st_size, stat.st_mtime_ns), spec.load_format, spec.dtype,
                       spec.quantization, prepared.model.dtype, prepared.layout)


def _release_device_memory() -> None:
    """Collect what still points at device tensors through a cycle and give the allocator's cache back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
