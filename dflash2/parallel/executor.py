"""Executor: rank 0's side of a parallel engine. It starts the other ranks, joins the process group with them,
drives them with messages, watches them, and stops them.

    Engine.__init__ ─► Executor(config): early checks ─► workers start (ProcessWorkers | RayWorkers) ─► each sets
                       its "joined" key in rank 0's store ─► every rank joins the process group ─► the watcher starts
    prepare_model   ─► load_shard: Load to every rank; each reads the whole model and keeps its part
    pool_num_pages  ─► gpu_num_pages (Profile: every rank profiles; the pool is the smallest rank's) and page_bytes
    build_runner    ─► runner: Serve to every rank (each builds its WorkerRunner); rank 0's DriverRunner
    Engine.close    ─► shutdown: Stop, the workers end (or are killed), the group is left
    (prepare_model, pool_num_pages, build_runner: the engine's, in engine/model_setup.py)

Failure: a worker that exits, or whose heartbeat (a counter it bumps in rank 0's store twice a second) stops for
heartbeat_timeout_s, fails the executor: `failure` says which and why (the server's /health reads it), every
worker is killed (a collective rank 0 is blocked in then raises at once), and every step from then on raises
WorkerFailed. A parallel engine does not recover from it: restart it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dflash2.engine.kv.layout import KVLayout
from dflash2.engine.runner import RunnerOptions
from dflash2.engine.storage import PoolStorage
from dflash2.loading.model_loader import LoadedModel, load_model
from dflash2.parallel.config import ParallelConfig
from dflash2.parallel.errors import WorkerFailed
from dflash2.parallel.groups import abort_world, join_world, leave_world
from dflash2.parallel.messages import Load, Profile, Serve, Stop
from dflash2.parallel.runner import DriverRunner
from dflash2.parallel.shard import ShardPlan, check_fits, local_layout, shard_model
from dflash2.parallel.worker import WorkerConfig, heartbeat_key, joined_key, profile_pages

if TYPE_CHECKING:
    from dflash2.engine.config import EngineConfig

logger = logging.getLogger("dflash2")

WATCH_INTERVAL_S = 0.5
FAILURE_GRACE_S = 2.0  # after a collective raised: how long to wait for the watcher to name the worker that failed
JOIN_TIMEOUT_S = 20.0  # workers told to stop end within this, or are killed


class Executor:
    def __init__(self, config: "EngineConfig") -> None:
        self.parallel = parallel = config.parallel
        self.failure: str | None = None
        self._failed = threading.Event()
        self._stopping = threading.Event()
        self._fail_lock = threading.Lock()
        self.groups = None
        self.plan: ShardPlan | None = None
        check_supported(config)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off unless asked for (docs/PARALLEL.md)
        self.workers = _workers(parallel, config.device)
        self.device = self.workers.devices[0]
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s on %s (%s executor)", parallel.describe(), ", ".join(map(str, self.workers.devices)),
                    parallel.backend)

    def _start(self, config: "EngineConfig") -> None:
        parallel = self.parallel
        world = parallel.world_size
        host = self.workers.store_host
        self.store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=_seconds(parallel.startup_timeout_s))
        init_method = f"tcp://{host}:{self.store.port}"
        level = logging.getLevelName(logging.getLogger("dflash2").getEffectiveLevel())
        threads = _threads_per_rank(world) if self.device.type == "cpu" else None
        self.workers.start(init_method, {rank: WorkerConfig(parallel, str(self.workers.devices[rank]), threads, level,
                                                            watch_parent=parallel.backend == "mp")
                                         for rank in range(1, world)})
        self._wait_joined()
        self.groups = join_world(0, parallel, self.device, self.store)
        threading.Thread(target=self._watch, args=(host, self.store.port), name="dflash2-rank-watcher",
                         daemon=True).start()

    def _wait_joined(self) -> None:
        """Until every worker has joined (set its key), one exits, or startup_timeout_s passes."""
        keys = [joined_key(rank) for rank in range(1, self.parallel.world_size)]
        deadline = time.monotonic() + self.parallel.startup_timeout_s
        while not self.store.check(keys):
            for rank in range(1, self.parallel.world_size):
                problem = self.workers.problem(rank)
                if problem is not None:
                    raise ValueError(f"worker rank {rank} ({self.workers.describe(rank)}) {problem} before joining "
                                     f"(its log is above)")
            if time.monotonic() > deadline:
                raise ValueError(f"the workers did not start within {self.parallel.startup_timeout_s:g} s")
            time.sleep(0.05)

    # -- what the engine calls ---------------------------------------------------------------------------
    def load_shard(self, model: str | None, load_format: str, dtype: str | torch.dtype, device: torch.device,
                   max_positions: int | None, seed: int = 0, tokenizer: str | None = None,
                   quantization: Any = None) -> LoadedModel:
        """load_model's arguments: every rank loads the model and keeps its part (this rank's is returned)."""
        arguments = dict(model=model, load_format=load_format, dtype=dtype, max_positions=max_positions, seed=seed,
                         tokenizer=tokenizer, quantization=quantization)
        self.send(Load(arguments))
        loaded, error = None, None
        try:
            loaded = load_model(**arguments, device=self.device,
                                shard=lambda module, arch: shard_model(module, arch, self.groups))
            self.plan = ShardPlan.of(loaded.arch, self.parallel, 0)
        except Exception as e:  # noqa: BLE001 - answered with the others', then raised
            error = e
        self._answers(error, "load its part of the model")
        return loaded

    def page_bytes(self, layout: KVLayout) -> int:
        """This rank's bytes of a page of the whole model's `layout`."""
        return local_layout(layout, self.plan).page_bytes

    def gpu_num_pages(self, model: LoadedModel, layout: KVLayout, options: RunnerOptions, max_num_batched_tokens: int,
                      max_num_seqs: int, graph_tokens: int, gpu_memory_utilization: float) -> int:
        """Every rank profiles a step and works out the pages its memory holds; the pool takes the fewest."""
        message = Profile(layout, options, max_num_batched_tokens, max_num_seqs, graph_tokens, gpu_memory_utilization)
        self.send(message)
        pages, error = None, None
        try:
            pages = profile_pages(model, message, self.plan, lambda m, whole, n, o: DriverRunner(
                m, local_layout(whole, self.plan), n, o, executor=self))
        except Exception as e:  # noqa: BLE001
            error = e
        answers = self._answers(error, "size its page pool", value=pages)
        return min(answers)

    def runner(self, model: LoadedModel, layout: KVLayout, num_pages: int, options: RunnerOptions,
               storage: PoolStorage | None = None) -> DriverRunner:
        """Every rank builds its runner on its own pool of `num_pages` pages; rank 0's drives the others."""
        self.send(Serve(layout, num_pages, storage.host_pages.shape[0] if storage is not None else 0, options))
        runner, error = None, None
        try:
            runner = DriverRunner(model, local_layout(layout, self.plan), num_pages, options, storage, executor=self)
        except Exception as e:  # noqa: BLE001
            error = e
        self._answers(error, "build its runner")
        return runner

    def send(self, message: Any) -> None:
        self.check()
        self.groups.send_message(message)

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def _answers(self, error: BaseException | None, what: str, value: Any = None) -> list[Any]:
        """Every rank's answer to the message just sent: rank 0's own error raised first, else the first worker's
        (ValueError naming the rank); else every rank's value."""
        statuses = self.groups.gather_status(value if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        for rank, status in enumerate(statuses):
            if isinstance(status, str):
                raise ValueError(f"rank {rank} could not {what}: {status}")
        return statuses

    @contextlib.contextmanager
    def step_failures(self) -> Iterator[None]:
        """Around rank 0's part of a step: any error in it (a collective whose peer died, or rank 0's own) leaves
        the ranks out of step, so it fails the executor and raises WorkerFailed naming what failed."""
        self.check()
        try:
            yield
        except WorkerFailed:
            raise
        except Exception as error:
            if not self._failed.wait(FAILURE_GRACE_S):  # the watcher names a worker that ended; else look here
                self._fail(self._worker_problem() or f"a step failed on rank 0 ({type(error).__name__}: {error}); "
                                                     f"the ranks are out of step")
            raise WorkerFailed(self.failure) from error

    def _worker_problem(self) -> str | None:
        for rank in range(1, self.parallel.world_size):
            problem = self.workers.problem(rank)
            if problem is not None:
                return f"worker rank {rank} ({self.workers.describe(rank)}) {problem}"
        return None

    # -- watching ------------------------------------------------------------------------------------------
    def _watch(self, host: str, port: int) -> None:
        """A thread: a worker that exits, or whose heartbeat stops for heartbeat_timeout_s, fails the executor."""
        client = dist.TCPStore(host, port, is_master=False, timeout=_seconds(30))
        ranks = range(1, self.parallel.world_size)
        seen = {rank: (-1, time.monotonic()) for rank in ranks}
        timeout = self.parallel.heartbeat_timeout_s
        while not self._stopping.wait(WATCH_INTERVAL_S) and self.failure is None:
            now = time.monotonic()
            for rank in ranks:
                problem = self.workers.problem(rank)
                if problem is None:
                    try:
                        beats = client.add(heartbeat_key(rank), 0)
                    except Exception:  # noqa: BLE001 - rank 0's store is closing: the engine is stopping
                        return
                    if beats != seen[rank][0]:
                        seen[rank] = (beats, now)
                    elif now - seen[rank][1] > timeout:
                        problem = f"sent no heartbeat for {now - seen[rank][1]:.0f} s (hung, or its host is gone)"
                if problem is not None and not self._stopping.is_set():
                    self._fail(f"worker rank {rank} ({self.workers.describe(rank)}) {problem}")
                    return

    def _fail(self, reason: str) -> None:
        """The first failure wins: recorded, logged, every worker killed (the group is of no use any more)."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = f"{reason}; the engine cannot run steps any more (restart it)"
        logger.error("parallel engine failed: %s", self.failure)
        for rank in range(1, self.parallel.world_size):
            self.workers.kill(rank)
        if self.device.type == "cuda":
            abort_world()  # NCCL kernels waiting on a dead peer end
        self._failed.set()

    # -- the end -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (Stop, then kill what is left) and leave the process group; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        told = False
        if self.groups is not None and self.failure is None:
            try:
                self.groups.send_message(Stop())
                told = True
            except Exception:  # noqa: BLE001 - a worker gone: the others are killed below
                logger.warning("could not tell every worker to stop; killing them")
        if not told:  # (a startup that failed: workers may wait to join a group that never forms)
            for rank in range(1, self.parallel.world_size):
                self.workers.kill(rank)
        self.workers.join(JOIN_TIMEOUT_S)
        if self.groups is not None:
            leave_world()
            self.groups = None


def check_supported(config: "EngineConfig") -> None:
    """ValueError for what a parallel engine does not do, and (where the model's shape can be read cheaply) for a
    split the model does not allow, before any worker starts."""
    parallel = config.parallel
    why = f"with {parallel.describe()}"
    if len(config.model_specs()) > 1:
        raise ValueError(f"several models in one engine are not supported {why}; run one server per model")
    if config.cache.l3_cache_path is not None:
        raise ValueError(f"the disk (L3) KV tier is not supported {why}: it reads page bytes from rank 0's pool "
                         f"only (--enable-l3-cache)")
    spec = config.model_specs()[0]
    check_model_fits(spec.model, spec.load_format or config.load_format, parallel)


def check_model_fits(model: str | None, load_format: str, parallel: ParallelConfig) -> None:
    """ValueError naming the numbers where the model (its config read here: a preset, an HF directory, a GGUF
    file's metadata) cannot be split as `parallel` says; nothing where it cannot be read (the load says why)."""
    from dflash2.loading import model_loader
    from dflash2.loading.tokenizer import bundled_model_path
    from dflash2.models import registry

    path = model or bundled_model_path()
    try:
        arch = registry.preset(path) if path in registry.PRESETS else model_loader._read_arch(path)
    except Exception:  # noqa: BLE001
        return
    check_fits(arch, parallel)


def _workers(parallel: ParallelConfig, device: str) -> Any:
    if parallel.backend == "ray":
        from dflash2.parallel.ray_workers import RayWorkers

        return RayWorkers(parallel, device)
    from dflash2.parallel.process_workers import ProcessWorkers

    return ProcessWorkers(parallel, device)


def _threads_per_rank(world_size: int) -> int:
    """CPU ranks share this host's cores: torch threads each (rank 0's own count is the caller's)."""
    from dflash2.cpu_threads import physical_cores_available

    return max(1, physical_cores_available() // world_size)


def _seconds(value: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=value)
