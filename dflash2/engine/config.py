"""EngineConfig: what an Engine is built from (frozen). Sizes found at run time live in the objects built from it
(model_setup.py), never written back."""
from __future__ import annotations

from dataclasses import dataclass, field

from dflash2.config import CacheConfig, SchedulerConfig
from dflash2.engine.served_model import ModelSpec
from dflash2.parallel.config import ParallelConfig


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
