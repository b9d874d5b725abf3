"""What rank 0 sends the other ranks on the control group: plain data, in this order.

    Load      the arguments of load_model (each rank loads the whole model, then keeps its part)
    Profile   (GPU) one profiling step on a pool of its own, to size each rank's page pool; each answers its budget
    Serve     the pool's page count, the whole KV layout (each rank takes its part) and the runner's options
    Step      one step plan, plus what the forward needs of its requests; many, until
    Stop
Load, Profile and Serve are answered (RankGroups.gather_status): None, a number (Profile), or the error a rank hit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash2.engine.kv.layout import KVLayout
from dflash2.engine.plan import StepPlan


@dataclass(frozen=True)
class Load:
    arguments: dict[str, Any]  # load_model's keyword arguments, `device` left out (each rank has its own)


@dataclass(frozen=True)
class Profile:
    layout: KVLayout  # the whole model's
    options: Any  # RunnerOptions
    max_num_batched_tokens: int
    max_num_seqs: int
    graph_tokens: int
    gpu_memory_utilization: float


@dataclass(frozen=True)
class Serve:
    layout: KVLayout  # the whole model's
    num_pages: int
    num_host_pages: int
    options: Any  # RunnerOptions


@dataclass(frozen=True)
class Step:
    plan: StepPlan
    # request id -> prompt length, for the chunks that want every position's logits (prompt logprobs)
    prompt_lengths: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Stop:
    pass
