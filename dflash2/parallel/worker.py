"""A rank other than 0: `worker_main(rank, world_size, init_method, config)`, the same for both executors (a
process of this host started as `python -m dflash2.parallel.worker RANK WORLD INIT_METHOD` with its WorkerConfig
pickled on stdin, or a Ray actor's method).

    join: a heartbeat thread (a counter in rank 0's store), the "joined" key, the process group
    loop: Load -> its part of the model | Profile -> its pool's pages | Serve -> its runner | Step... | Stop

A worker answers Load, Profile and Serve on the control group (its error as text, which rank 0 raises naming it).
A step that raises, or a collective that fails (rank 0 or a peer gone), ends the process: rank 0's watcher
reports it. A worker started by the mp executor also ends when rank 0's process does (its parent).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash2.parallel.config import ParallelConfig

logger = logging.getLogger("dflash2")

HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    parallel: ParallelConfig
    device: str  # this rank's: "cpu", "cuda:N"
    num_threads: int | None  # torch threads (None: torch's default)
    log_level: str
    watch_parent: bool = False  # end when the process that started this one ends (the mp executor)


def joined_key(rank: int) -> str:
    return f"dflash2/joined/{rank}"


def heartbeat_key(rank: int) -> str:
    return f"dflash2/heartbeat/{rank}"


def worker_main(rank: int, world_size: int, init_method: str, config: WorkerConfig) -> None:
    from dflash2.parallel.groups import join_world, leave_world

    logging.basicConfig(level=getattr(logging, str(config.log_level).upper(), logging.WARNING),
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if config.watch_parent:
        _end_with_parent()
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = _seconds(config.parallel.startup_timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    _start_heartbeat(host, int(port), rank)
    store.set(joined_key(rank), "1")
    device = torch.device(config.device)
    groups = join_world(rank, config.parallel, device, store)
    logger.info("rank %d of %d joined on %s (pid %d)", rank, world_size, device, os.getpid())
    worker = _Worker(groups, device)
    try:
        worker.serve()
    except Exception:  # noqa: BLE001 - rank 0 reports this rank's end; the log says why
        logger.exception("rank %d: failed in a step or lost rank 0; exiting", rank)
        logging.shutdown()
        os._exit(1)
    leave_world()


class _Worker:
    def __init__(self, groups: Any, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self.model = None
        self.plan = None
        self.runner = None

    def serve(self) -> None:
        from dflash2.parallel.messages import Load, Profile, Serve, Step, Stop

        handlers: dict[type, Callable[[Any], Any]] = {Load: self.load, Profile: self.profile, Serve: self.build_runner}
        while True:
            message = self.groups.receive_message()
            if isinstance(message, Step):
                self.runner.run_step(message)
            elif isinstance(message, Stop):
                return
            else:
                self._answer(handlers[type(message)], message)

    def _answer(self, handler: Callable[[Any], Any], message: Any) -> None:
        """Run a startup message's handler and answer rank 0 with its value, or its error as text."""
        try:
            status = handler(message)
        except Exception as error:  # noqa: BLE001 - rank 0 raises it, naming this rank
            logger.exception("rank %d: %s failed", self.groups.rank, type(message).__name__)
            status = f"{type(error).__name__}: {error}"
        self.groups.gather_status(status)

    def load(self, message: Any) -> None:
        from dflash2.loading.model_loader import load_model
        from dflash2.parallel.shard import ShardPlan, shard_model

        groups = self.groups
        self.model = load_model(**message.arguments, device=self.device, with_tokenizer=False,
                                shard=lambda module, arch: shard_model(module, arch, groups))
        self.plan = ShardPlan.of(self.model.arch, groups.parallel, groups.rank)

    def profile(self, message: Any) -> int:
        from dflash2.parallel.runner import WorkerRunner
        from dflash2.parallel.shard import local_layout

        return profile_pages(self.model, message, self.plan, lambda model, whole, num_pages, options: WorkerRunner(
            model, local_layout(whole, self.plan), num_pages, options, self.groups))

    def build_runner(self, message: Any) -> None:
        from dflash2.parallel.runner import WorkerRunner
        from dflash2.parallel.shard import local_layout

        layout = local_layout(message.layout, self.plan)
        self.runner = WorkerRunner(self.model, layout, message.num_pages, message.options, self.groups)
        if self.runner.storage.host_pages.shape[0] != message.num_host_pages:
            raise RuntimeError(f"{self.runner.storage.host_pages.shape[0]} host pages here, "
                               f"{message.num_host_pages} on rank 0")


def profile_pages(model: Any, message: Any, plan: Any, runner_factory: Callable[..., Any]) -> int:
    """Pages of this rank's size its GPU holds after a profiling step (run by every rank together)."""
    from dflash2.engine.memory import gpu_pool_bytes, profile_model_memory
    from dflash2.parallel.shard import local_layout

    need = profile_model_memory(model, message.layout, message.options, message.max_num_batched_tokens,
                                message.max_num_seqs, graph_tokens=message.graph_tokens,
                                runner_factory=runner_factory)
    budget = gpu_pool_bytes(model.device, [need], message.gpu_memory_utilization)
    return budget // local_layout(message.layout, plan).page_bytes


def _start_heartbeat(host: str, port: int, rank: int) -> None:
    """Bump this rank's counter in rank 0's store every HEARTBEAT_INTERVAL_S (a client of its own: thread-safe)."""
    client = dist.TCPStore(host, port, is_master=False, timeout=_seconds(30))
    key = heartbeat_key(rank)

    def beat() -> None:
        while True:
            try:
                client.add(key, 1)
            except Exception:  # noqa: BLE001 - rank 0 gone: the control group's error ends this process
                return
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="dflash2-heartbeat", daemon=True).start()


def _end_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # rank 0's process is gone

    threading.Thread(target=watch, name="dflash2-parent-watch", daemon=True).start()


def _seconds(value: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=value)


def main() -> None:
    """`python -m dflash2.parallel.worker RANK WORLD_SIZE INIT_METHOD`, its WorkerConfig pickled on stdin."""
    rank, world_size, init_method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = pickle.load(sys.stdin.buffer)
    worker_main(rank, world_size, init_method, config)


if __name__ == "__main__":
    main()
