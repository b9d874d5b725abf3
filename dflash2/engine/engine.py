"""Engine: owns the requests and runs the step loop   plan -> launch -> commit.

    add_request() ─► Scheduler.waiting
    step():  Scheduler.plan() ─► StepPlan ─► ModelRunner.launch() ─► PendingStep ─► collect ─► Committer.commit()
             commit writes the sampled tokens, checks stop conditions, frees finished requests' pages and
             returns one RequestOutput per request that produced something.

Overlapped (the default on GPU): step N+1 is planned and launched before step N is committed.

    host:    plan N+1 | launch N+1 | collect+commit N | plan N+2 | launch N+2 | collect+commit N+1 ...
    device:  ...... step N ......  | ............ step N+1 ...........| ......... step N+2 ....

A step that samples the first token of a request that outranks a running request, and that no request in the
step outranks, is committed in the same call, right after its launch, so that token is not held back for the
next step's launch (the next step then starts from an idle device; same-priority batches never take this path,
nor does a less urgent first token while a more urgent request runs: the device would idle for it).

Several models (EngineConfig.models): each has its own scheduler, KV manager and runner (ServedModel) on one
page pool; a step runs one model's batch, the model step_order.py picks. Preemption crosses models
(Scheduler.peers). Models load and unload while the others serve (load_model, unload_model).

Beside it: admission.py (prompt -> token ids, a request's checks), commit.py (a step's tokens -> requests ->
outputs), model_setup.py (weights and sizes, the pool's size), disk_cache.py (the engine's side of the L3 tier).

Step N's sampled tokens are not known on the host when N+1 is planned, so each request gets a
placeholder token (resolved on the device from the runner's future-token buffer, and on the host at
commit). A request that hits max_tokens is marked finish_pending so it is not scheduled again; one that
stops on EOS or a stop string costs one wasted row in the next step.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time

import torch

from dflash2.config import SchedulerConfig
from dflash2.engine.admission import PromptInput, tokenize, validate
from dflash2.engine.commit import Committer
from dflash2.engine.config import EngineConfig
from dflash2.engine.detokenizer import IncrementalDetokenizer
from dflash2.engine.disk_cache import PrefillRate, build_disk_tier, model_fingerprint, persist_tiers
from dflash2.engine.kv.disk_tier import DiskTier
from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.plan import StepPlan
from dflash2.engine.guided import GrammarCompilers
from dflash2.engine.held_requests import HeldRequests, prompt_computed
from dflash2.engine.memory import release_cublas_workspaces, release_device_memory
from dflash2.engine.model_setup import build_runner, pool_num_pages, prepare_model, resolve_device
from dflash2.engine.runner import ModelRunner, PendingStep
from dflash2.engine.sampler import make_generator
from dflash2.engine.scheduler import Scheduler
from dflash2.engine.served_model import ModelSpec, PreparedModel, ServedModel
from dflash2.engine.step_order import first_token_is_urgent, plan_next, step_priorities
from dflash2.engine.storage import PoolStorage
from dflash2.engine.step_trace import StepTrace
from dflash2.loading.model_loader import LoadedModel
from dflash2.request import Request, RequestOutput, RequestStatus, check_priority
from dflash2.sampling_params import MAX_PRIORITY, SamplingParams


logger = logging.getLogger("dflash2")


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
        self._committer = Committer(self.requests, config.stream_interval)  # a step's tokens -> outputs (commit.py)
        self._held = HeldRequests()  # taken, not yet scheduled (held_requests.py)
        self._grammars = GrammarCompilers()  # structured output (guided.py)
        self._in_flight: tuple[ServedModel, StepPlan, PendingStep] | None = None
        self.trace: StepTrace | None = None
        self.disk_tier: DiskTier | None = None
        self._admissions = itertools.count()  # shared by the models' schedulers (cross-model victim order)
        loaded = []
        try:
            for spec in specs:  # every model's weights first: the pool takes what they leave
                loaded.append(self._load(spec, single=len(specs) == 1))
            names = [prepared.name for prepared in loaded]
            if len(set(names)) != len(names):
                raise ValueError(f"two models have the same name ({', '.join(names)}); name them with NAME=PATH")
            num_pages = pool_num_pages(config, device, self.executor, loaded)
        except BaseException:
            loaded.clear()
            if self.executor is not None:
                self.executor.shutdown()
            release_device_memory()
            raise
        num_host_pages = cache.swap_space_bytes // cache.page_bytes
        # a parallel rank's pages hold its part of each token (its KV heads and layers): same tokens, fewer bytes
        page_bytes = cache.page_bytes if self.executor is None else self.executor.page_bytes(loaded[0].layout)
        self.storage = PoolStorage(num_pages, page_bytes, num_host_pages, device)
        self.pool = PagePool(num_pages, cache.page_bytes)
        self.host_pool = HostPagePool(num_host_pages) if num_host_pages else None
        # the host pages are also the L2 tier: cached pages the device evicts are copied down, not dropped
        self.pool.keep_evicted = self.host_pool is not None and cache.enable_prefix_caching
        self.disk_tier = build_disk_tier(cache, self.host_pool, self.storage) \
            if self.pool.keep_evicted and cache.l3_cache_path else None
        self._prefill_rate = PrefillRate(self.disk_tier) if self.disk_tier is not None else None
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
        self._ids = itertools.count()
        # where the latest step's host time went (server metrics read them): Scheduler.plan(), building inputs
        # and launching the kernels, and waiting for a step's results (the device) and committing them
        self.last_plan_seconds = self.last_launch_seconds = self.last_finish_seconds = 0.0

    # -- the models --------------------------------------------------------------------------------
    def _load(self, spec: ModelSpec, single: bool) -> PreparedModel:
        """Load one model's weights and work out its sizes (nothing of the pool yet)."""
        return prepare_model(self.config, spec, self.device, self.executor, single)

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
            self.disk_tier.add_model(name, model_fingerprint(prepared))
        scheduler = Scheduler(scheduler_config, kv, admissions=self._admissions)
        runner, eos_token_ids = build_runner(self.config, prepared, self.pool.num_pages, self.storage, self.executor)
        served = ServedModel(name, spec, model, scheduler_config, max_model_len, layout, kv, scheduler, runner,
                             eos_token_ids)
        self.models[name] = served
        self._link_peers()
        logger.info("model %s: %d layers, weights %s, KV %s, %d tokens a page (pool: %d pages, %d of its tokens), "
                    "max_model_len %d", name, model.arch.num_layers, served.describe()["weights"], layout.dtype,
                    layout.tokens_per_page, self.pool.num_pages, self.pool.num_pages * layout.tokens_per_page,
                    max_model_len)
        return served

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
            release_device_memory()
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
                release_device_memory()

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
        release_device_memory()
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

    def num_waiting_ahead(self, request: Request) -> int | None:
        """How many requests wait before this one in its model's line (None: it is not waiting there)."""
        served = self.models.get(request.model)
        return None if served is None else served.scheduler.waiting.num_ahead(request)

    @property
    def num_running(self) -> int:
        """Requests in service: admitted to a step and not finished, preempted or waiting."""
        return sum(len(served.scheduler.running) for served in self.models.values())

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
        prompt_text, token_ids = tokenize(served, prompt)
        validate(served, token_ids, params, self.pool.num_pages)
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
        self._committer.detokenizers[request_id] = IncrementalDetokenizer(served.tokenizer, token_ids, params)
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
        self._committer.detokenizers.pop(request_id, None)

    def close(self) -> None:
        """Free what the engine holds on the device and the host (page pool, CUDA graphs, pinned buffers, the
        models) and end its requests; idempotent. Dropping the last reference to the engine does the same."""
        if getattr(self, "storage", None) is None:
            return
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = None
        if self.disk_tier is not None:
            persist_tiers(self.disk_tier, self.device, self.pool, self.host_pool, self.storage,
                          self.config.cache.l3_flush_timeout_s)
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
        release_cublas_workspaces()  # (only here: a captured graph of a model still loaded may use them)
        release_device_memory()

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
            urgent_first_token = self._urgent_first_token(plan)
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
        return plan_next(self.models, self._num_steps, self.config.max_model_skip_steps)

    def _launch(self, served: ServedModel, plan: StepPlan) -> PendingStep:
        self.last_model = served.name
        self._mark_scheduled(plan)
        trace = None
        if self.trace:
            _, top, first_token_top = step_priorities(plan, self.requests)
            trace = self.trace.begin(plan, top, first_token_top, self.last_plan_seconds)
        launch_started = time.perf_counter()
        pending = served.runner.launch(plan, self.requests)
        if self.disk_tier is not None:  # after the launch queued its copies down to host pages
            self.disk_tier.write_ahead()
        self.last_launch_seconds = time.perf_counter() - launch_started
        if trace is not None:
            self.trace.launched(trace, self.last_launch_seconds, served.runner.last_graph)
            pending.trace = trace
        return pending

    def _urgent_first_token(self, plan: StepPlan) -> bool:
        """Whether the step is committed at once (step_order.first_token_is_urgent)."""
        return first_token_is_urgent(step_priorities(plan, self.requests), self.models.values())

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
            self._prefill_rate.measure(plan)
        outputs = self._committer.commit(served, plan, result, pending.placeholders if placeholders else None)
        elapsed = time.perf_counter() - started
        self.last_finish_seconds += elapsed
        if pending.trace is not None:
            self.trace.finished(pending.trace, elapsed)
        return outputs

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of the requests ended by a failure since the last call: no output comes for
        them; the caller tells their clients."""
        return self._committer.take_failures()


def _no_room_for(model: str | None) -> ValueError:
    return ValueError(f"not enough device memory to load {model!r} beside the models loaded; unload one or start "
                      f"with a smaller --gpu-memory-utilization / --kv-cache-memory")
