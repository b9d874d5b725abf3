"""RankGroups: one rank's place among the ranks, and the torch.distributed groups it talks through.

    group     backend (GPU / CPU)   carries
    world     nccl / gloo           the sampled tokens (rank 0 -> every rank), a stage's activations to the next
                                    stage (send / recv), the last stage's logits to rank 0
    tensor    nccl / gloo           a stage's all-reduces and all-gathers (the world itself when there is one stage)
    control   gloo                  the messages rank 0 drives the others with (plain data, pickled) and their
                                    answers at startup; its timeout is long, since a worker waits on it while the
                                    engine idles

Ranks: rank = stage * tp_size + tp_rank. Rank r of a stage sends its activations to rank r + tp_size (the same
tensor-parallel rank of the next stage: every rank of a stage holds the same hidden states after its all-reduce).
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from dflash2.parallel.config import ParallelConfig

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # a worker waits on the control group while the engine is idle


class RankGroups:
    def __init__(self, rank: int, parallel: ParallelConfig, device: torch.device, control: Any, tensor: Any) -> None:
        self.rank = rank
        self.parallel = parallel
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        self.tp_rank, self.stage = rank % self.tp_size, rank // self.tp_size
        self.device = device
        self.control, self.tensor = control, tensor

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def last_stage_leader(self) -> int:
        """The rank that sends the last stage's logits to rank 0."""
        return (self.pp_size - 1) * self.tp_size

    # -- the tensor group ------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the stage's tensor-parallel ranks, in place (every rank gets the same bits)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tensor)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's x (all of one shape), in rank order."""
        x = x.contiguous()
        if self.tp_size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tensor)
        return parts

    # -- the world -------------------------------------------------------------------------------------
    def send_activations(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        for tensor in (x, residual):
            dist.send(tensor.contiguous(), self.rank + self.tp_size)

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        received = []
        for _ in range(2):
            tensor = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
            dist.recv(tensor, self.rank - self.tp_size)
            received.append(tensor)
        return received[0], received[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        dist.send(logits.contiguous(), 0)

    def recv_logits(self, num_rows: int, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
        logits = torch.empty((num_rows, vocab_size), dtype=dtype, device=self.device)
        dist.recv(logits, self.last_stage_leader)
        return logits

    def broadcast_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0's sampled tokens into every rank's copy of `tokens` (a slice of its future-token buffer)."""
        dist.broadcast(tokens, 0)

    # -- the control group -----------------------------------------------------------------------------
    def send_message(self, message: Any) -> None:
        """Rank 0: hand every other rank this message (plain data)."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive_message(self) -> Any:
        """A worker: the next message from rank 0 (waits as long as the engine idles)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_status(self, status: Any) -> list[Any]:
        """Every rank's status (None: done; else what went wrong), in rank order."""
        statuses: list[Any] = [None] * self.world_size
        dist.all_gather_object(statuses, status, group=self.control)
        return statuses


def join_world(rank: int, parallel: ParallelConfig, device: torch.device, store: dist.Store) -> RankGroups:
    """Join the process group (every rank calls this at once; the store is rank 0's) and build the groups."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=parallel.world_size,
                            timeout=datetime.timedelta(seconds=parallel.collective_timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tensor = dist.group.WORLD
    tp = parallel.tensor_parallel_size
    if parallel.pipeline_parallel_size > 1:
        for stage in range(parallel.pipeline_parallel_size):  # every rank creates every group, in one order
            group = dist.new_group(ranks=list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                tensor = group
    return RankGroups(rank, parallel, device, control, tensor)


def leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def abort_world() -> None:
    """Abort the process groups where the backend can (NCCL: kernels waiting on a dead peer end); best effort."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:  # noqa: BLE001 - gloo, or a group already torn down
            pass
