"""ParallelConfig: how many ranks split one model, and what starts them (DESIGN.md decision 8).

    world = tensor_parallel_size x pipeline_parallel_size ranks; rank = stage * tensor_parallel_size + tp_rank
    (a stage's tensor-parallel ranks are neighbours: on one host, the GPUs that share NVLink)

Rank 0 is the engine's own process; the executor ("mp": processes on this host, "ray": Ray actors on a cluster)
starts the others. One rank with no executor named is the plain engine, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "mp" for several ranks, else one process; "uni": one process (refused for several ranks)
    distributed_executor_backend: str | None = None
    ray_address: str | None = None  # "auto", "HOST:PORT" or "ray://HOST:PORT"; None: a running cluster or a local one
    # a collective of a step (all-reduce, send / recv) waits this long at most before it raises
    collective_timeout_s: float = 600.0
    # a worker whose heartbeat stops this long (stopped, or its host gone) is taken for hung and killed
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 600.0  # the workers start and join the process group within this

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"unknown distributed_executor_backend {backend!r}; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one process, but tensor_parallel_size "
                             f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} "
                             f"needs {self.world_size} ranks: use 'mp' or 'ray'")
        if self.ray_address is not None and backend not in (None, "ray"):
            raise ValueError(f"ray_address is for distributed_executor_backend 'ray', not {backend!r}")
        for name in ("collective_timeout_s", "heartbeat_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        """The executor that runs the ranks: "uni" (the engine alone, no executor), "mp" or "ray"."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        if self.ray_address is not None:
            return "ray"
        return "mp" if self.world_size > 1 else "uni"

    @property
    def uses_executor(self) -> bool:
        """Whether the engine runs through an executor (several ranks, or one asked for by name: TP=1 over NCCL)."""
        return self.backend != "uni"

    def describe(self) -> str:
        return (f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} = {self.world_size} rank{'s' if self.world_size > 1 else ''}")
