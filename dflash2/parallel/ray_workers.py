"""RayWorkers (the "ray" executor): the ranks but 0 as Ray actors, one per bundle of a placement group.

    placement group: one bundle per rank ({"GPU": 1, "CPU": 1}, or {"CPU": 1} on the CPU), packed onto as few nodes
                     as fit; bundle 0 is pinned to this node (the engine is rank 0) and, on GPUs, held by a small
                     actor that tells which GPU Ray gave it: the engine runs on that one
    actor r:         worker_main(r, ...) in its bundle (Ray sets its CUDA_VISIBLE_DEVICES: cuda:0 there), with this
                     process's NCCL_* / GLOO_* / TORCH_NCCL_* / DFLASH2_* variables and PYTHONPATH
    death:           its run() call's ObjectRef resolves (Ray reports the actor's end); a hang: the heartbeat

Ray is optional (`pip install 'dflash2[ray]'`). `ray_address`: "auto" (the cluster running here), "HOST:PORT", or
None (RAY_ADDRESS, else a new local instance, shut down with the engine).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from dflash2.parallel.config import ParallelConfig

logger = logging.getLogger("dflash2")

PASSED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "DFLASH2_", "TRITON_")


class _RemoteWorker:
    """The actor: a rank's worker_main in a Ray worker process."""

    def pid(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, rank: int, world_size: int, init_method: str, config: Any) -> None:
        from dflash2.parallel.worker import worker_main

        worker_main(rank, world_size, init_method, config)


class _GpuHolder:
    """Holds bundle 0's GPU for the engine's process (rank 0) and says which one it is."""

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()


class RayWorkers:
    def __init__(self, parallel: ParallelConfig, device: str) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'dflash2[ray]'") from None
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.world_size = world = parallel.world_size
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=parallel.ray_address, include_dashboard=False, log_to_driver=True)
        self.store_host = ray.util.get_node_ip_address()
        gpu = _wants_gpu(device)
        kind = "GPU" if gpu else "CPU"
        available = ray.cluster_resources().get(kind, 0)
        if available < world:
            self._stop_ray()
            raise ValueError(f"{parallel.describe()} need {world} {kind}s, but the Ray cluster has {available:g}")
        bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
        bundles[0][f"node:{self.store_host}"] = 0.001  # rank 0 is this process
        self.group = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=parallel.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._stop_ray()
            raise ValueError(f"the Ray cluster could not place {world} bundles of {bundles[1] if world > 1 else bundles[0]} "
                             f"within {parallel.startup_timeout_s:g} s") from None
        self.holder = None
        self.devices = [self._driver_device(gpu)] + [torch.device("cuda:0" if gpu else "cpu")] * (world - 1)
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}
        self.where: dict[int, tuple[int, str]] = {}

    def _strategy(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)

    def _driver_device(self, gpu: bool) -> torch.device:
        """The GPU Ray gave bundle 0, as this process numbers its devices (or the CPU)."""
        if not gpu:
            return torch.device("cpu")
        holder = self.ray.remote(_GpuHolder).options(num_cpus=0, num_gpus=1,
                                                     scheduling_strategy=self._strategy(0)).remote()
        self.holder = holder
        gpu_id = str(self.ray.get(holder.gpu_ids.remote())[0])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not visible:
            return torch.device("cuda", int(gpu_id))
        listed = [entry.strip() for entry in visible.split(",")]
        if gpu_id not in listed:
            raise ValueError(f"Ray gave the engine's rank GPU {gpu_id}, which CUDA_VISIBLE_DEVICES={visible} hides")
        return torch.device("cuda", listed.index(gpu_id))

    def start(self, init_method: str, configs: dict[int, Any]) -> None:
        gpu = self.devices[0].type == "cuda"
        remote = self.ray.remote(_RemoteWorker)
        env = actor_environment()
        for rank, config in configs.items():
            actor = remote.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=self._strategy(rank),
                                   runtime_env={"env_vars": env}, name=None).remote()
            self.actors[rank] = actor
            self.where[rank] = self.ray.get(actor.pid.remote())
            self.runs[rank] = actor.run.remote(rank, self.world_size, init_method, config)

    def problem(self, rank: int) -> str | None:
        run = self.runs.get(rank)
        if run is None:
            return None
        ready, _ = self.ray.wait([run], timeout=0)
        if not ready:
            return None
        try:
            self.ray.get(run)
        except Exception as error:  # noqa: BLE001 - the actor died or its run raised
            return f"ended: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return "ended"

    def describe(self, rank: int) -> str:
        pid, node = self.where.get(rank, (0, "?"))
        return f"Ray actor, pid {pid} on {node}"

    def pid(self, rank: int) -> int:
        return self.where[rank][0]

    def kill(self, rank: int) -> None:
        actor = self.actors.get(rank)
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def join(self, timeout_s: float) -> None:
        runs = list(self.runs.values())
        if runs:
            self.ray.wait(runs, num_returns=len(runs), timeout=timeout_s)
        for rank in list(self.actors):
            self.kill(rank)
        if self.holder is not None:
            self.ray.kill(self.holder)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        self._stop_ray()

    def _stop_ray(self) -> None:
        if self.started_ray and self.ray.is_initialized():
            self.ray.shutdown()


def _wants_gpu(device: str) -> bool:
    if device == "auto":
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def actor_environment() -> dict[str, str]:
    """The variables an actor gets from this process: NCCL and gloo settings, ours, and this dflash2 first on
    PYTHONPATH (a node without that directory imports its installed dflash2)."""
    from dflash2.parallel.process_workers import worker_environment

    env = worker_environment()
    return {name: value for name, value in env.items()
            if name.startswith(PASSED_ENV_PREFIXES) or name == "PYTHONPATH"}
