"""What crosses between the HTTP side and the EngineLoop, whatever the transport: the loop's commands (Submit,
Abort, LoadModel, UnloadModel, EndAll, DescribeModels, Stop), what the HTTP side reads of the loaded models
(EngineInfo, ModelInfo) and the errors a request can end with (EngineError, QueueFull)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dflash2.engine.served_model import ModelSpec
from dflash2.sampling_params import SamplingParams
from dflash2.server.observer import StreamTiming


class EngineError(RuntimeError):
    """The engine failed while running a request (a bug, or the device failed); the request is lost."""


class QueueFull(Exception):
    """--max-queue-len requests are already waiting (503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side reads of one loaded model (it never changes while the model is loaded)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any  # None: the model has no tokenizer (clients send token ids)
    weights: str  # its weight formats, as the logs say them
    kv_cache_dtype: str

    @classmethod
    def of(cls, served: Any) -> ModelInfo:
        card = served.describe()
        return cls(served.name, served.model.arch.vocab_size, served.max_model_len, served.tokenizer,
                   card["weights"], card["kv_cache_dtype"])


@dataclass(frozen=True)
class EngineInfo:
    """The loaded models, in load order (a new EngineInfo replaces it when one loads or unloads)."""

    models: dict[str, ModelInfo]

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls({name: ModelInfo.of(served) for name, served in engine.models.items()})

    @property
    def default(self) -> ModelInfo:
        """The first model (the only one, on a single-model server)."""
        return next(iter(self.models.values()))


@dataclass
class Submit:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
    priority: int
    outputs: Any = None  # where the transport delivers this request's outputs (EngineThread: an asyncio.Queue)
    accepted: Any = None  # how the transport answers the submission (EngineThread: an asyncio.Future)
    timing: StreamTiming | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    model: str | None = None  # None: the only model loaded
    shares_prompt_with: str | None = None  # another sample of the same prompt (Engine.add_request)


@dataclass
class Abort:
    request_id: str


@dataclass
class LoadModel:
    spec: ModelSpec
    reply: Any = None  # how the transport answers (EngineThread: an asyncio.Future; the process: a number)


@dataclass
class UnloadModel:
    name: str
    force: bool = False  # end its requests now instead of letting them finish
    reply: Any = None


@dataclass
class EndAll:
    """End every request in the engine with this message (the server's drain ran out of time)."""

    message: str


@dataclass
class DescribeModels:
    """Each model's formats and current KV use (/v1/models)."""

    reply: Any = None


class Stop:
    pass
