"""One model of an engine: what to load (ModelSpec) and what it runs with once loaded (ServedModel).

An engine serves one or several models on one page pool (DESIGN.md decision 6). Each ServedModel has its own
weights, KV layout (its tokens per page), KVManager (its page tables and prefix cache, named after the model),
Scheduler and ModelRunner; the pool's pages, its bytes (PoolStorage), the host swap pages and the request ids
are the engine's, shared by all of them.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash2.config import SchedulerConfig

if TYPE_CHECKING:
    from dflash2.engine.kv.layout import KVLayout
    from dflash2.engine.kv.manager import KVManager
    from dflash2.engine.runner import ModelRunner, RunnerOptions
    from dflash2.engine.scheduler import Scheduler
    from dflash2.loading.model_loader import LoadedModel

@dataclass(frozen=True)
class ModelSpec:
    """A model to serve and its own options; a None option takes the engine's.

    `model`: an HF directory, a .gguf file, a `dflash2 convert` output or a preset name (dummy weights); None:
    the bundled model. `name`: what requests call it (None: the file or directory stem; for a single model
    served alone, the loader's name as before). `min_pool_share` / `max_pool_share`: the fraction of the
    pool's pages this model keeps within reach (the others cannot take them while it uses fewer) and may use
    at most. `quantization` ("int8", "int6", "int4"): dummy weights made quantized so (benchmarks; the
    embedding stays 16-bit), for load_format "dummy" only.
    """

    model: str | None = None
    name: str | None = None
    tokenizer: str | None = None
    load_format: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    max_num_seqs: int | None = None
    min_pool_share: float = 0.0
    max_pool_share: float | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not self.name or self.name != self.name.strip()):
            raise ValueError(f"a model name must be a non-empty string without surrounding spaces, got {self.name!r}")
        if not 0.0 <= self.min_pool_share <= 1.0:
            raise ValueError(f"min_pool_share must be in [0, 1], got {self.min_pool_share}")
        if self.max_pool_share is not None and not 0.0 < self.max_pool_share <= 1.0:
            raise ValueError(f"max_pool_share must be in (0, 1], got {self.max_pool_share}")
        if self.max_pool_share is not None and self.max_pool_share < self.min_pool_share:
            raise ValueError(f"max_pool_share {self.max_pool_share} is below min_pool_share {self.min_pool_share}")
        if self.quantization is not None:
            from dflash2.quantization.config import parse_bits

            parse_bits(self.quantization)  # ValueError naming the choices (load_format checked at load)
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @classmethod
    def parse(cls, value: str) -> "ModelSpec":
        """`--model PATH` or `--model NAME=PATH` (a path holding '=' is taken whole when it exists)."""
        name, sep, path = value.partition("=")
        if not sep or os.path.exists(value) or not name:
            return cls(model=value)
        return cls(model=path, name=name)

    @classmethod
    def from_dict(cls, entry: dict) -> "ModelSpec":
        """One entry of a --models-config file: its keys are the fields (`path` is taken for `model`)."""
        if not isinstance(entry, dict):
            raise ValueError(f"a model entry must be a mapping, got {type(entry).__name__}")
        entry = dict(entry)
        if "path" in entry:
            if "model" in entry:
                raise ValueError("a model entry has both 'path' and 'model'")
            entry["model"] = entry.pop("path")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(entry) - set(known))
        if unknown:
            raise ValueError(f"unknown model option(s) {', '.join(unknown)}; known: path, {', '.join(known)}")
        return cls(**entry)

    def quant_config(self):  # noqa: ANN201 - QuantConfig | None
        """The dummy weights' quantization (None: float weights)."""
        if self.quantization is None:
            return None
        from dflash2.quantization.config import QuantConfig, parse_bits

        return QuantConfig.build(parse_bits(self.quantization), group_bits={"embed": 16})

    def served_name(self) -> str | None:
        """The name given, else the stem of the file or directory (None: let the loader name it)."""
        if self.name is not None:
            return self.name
        if self.model is None:
            return None
        path = Path(os.path.normpath(self.model))
        return path.stem if path.suffix == ".gguf" else path.name


@dataclass
class PreparedModel:
    """A model whose weights are loaded and sizes worked out, not yet on the pool (Engine.prepare_model)."""

    name: str
    spec: ModelSpec
    model: "LoadedModel"
    scheduler_config: SchedulerConfig
    max_model_len: int
    layout: "KVLayout"
    options: "RunnerOptions"


class ServedModel:
    """A loaded model with its KV manager, scheduler and runner on the engine's shared pool."""

    def __init__(self, name: str, spec: ModelSpec, model: "LoadedModel", scheduler_config: SchedulerConfig,
                 max_model_len: int, layout: "KVLayout", kv: "KVManager", scheduler: "Scheduler",
                 runner: "ModelRunner", eos_token_ids: set[int]) -> None:
        self.name = name
        self.spec = spec
        self.model = model
        self.scheduler_config = scheduler_config
        self.max_model_len = max_model_len
        self.layout = layout
        self.kv = kv
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.last_step = 0  # the engine's step count when this model last stepped
        self.skipped_steps = 0  # steps since then in which it had work but another model stepped
        self.closing = False  # being unloaded: takes no new requests

    @property
    def tokenizer(self):  # noqa: ANN201 - a Hugging Face tokenizer, or None
        return self.model.tokenizer

    def describe(self) -> dict:
        """What /v1/models and the logs say about it: formats and KV use."""
        quant = self.model.quant
        return {"name": self.name, "path": self.model.path, "weights": quant.describe() if quant is not None
                else str(self.model.dtype).replace("torch.", ""), "kv_cache_dtype": self.layout.kv_dtype,
                "tokens_per_page": self.layout.tokens_per_page, "max_model_len": self.max_model_len,
                "max_num_seqs": self.scheduler_config.max_num_seqs, "kv_pages_used": self.kv.num_used,
                "kv_pages_cached": self.kv.num_cached, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}
