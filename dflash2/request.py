"""Request: one generation in flight, and what the engine hands back for it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash2.sampling_params import MAX_PRIORITY, SamplingParams

if TYPE_CHECKING:
    from dflash2.engine.sampler import Logprob


def check_priority(priority: object) -> int:
    """A request priority: an integer in [0, MAX_PRIORITY] (bool is not one); ValueError otherwise."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [0, {MAX_PRIORITY}], got {priority!r}")
    return priority


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """The scheduler's view of one request: its tokens and how many of them have KV in the cache.

    `token_ids` is the prompt followed by every generated token. Tokens [0, num_computed_tokens) have KV
    in the request's pages; the scheduler moves that mark forward, or back to 0 when it preempts.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 priority: int = 0, arrival_time: float | None = None, prompt: str | None = None,
                 model: str | None = None) -> None:
        check_priority(priority)
        self.request_id = request_id
        self.prompt = prompt
        self.model = model
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # time.monotonic() of the first step that ran it
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        # Set when the host knows the request will finish once in-flight steps land (overlapped steps).
        self.finish_pending = False
        self.stop_reason: int | str | None = None
        self.num_streamed_tokens = 0  # output tokens already handed out in a RequestOutput
        self.generator: Any = None  # torch.Generator when sampling_params.seed is set
        self.sampling_row: Any = None  # the runner's SamplingRow for steps that read no token history
        self.guided: Any = None  # engine/guided.py's GuidedState when the output must match a grammar
        self.logprobs: list[dict[int, Logprob]] | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.cumulative_logprob = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, priority={self.priority}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


class TokenView(Sequence[int]):
    """A read-only window on a request's token list: outputs made every step share it instead of copying."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self._materialize()[index]
        return self._tokens[range(self._start, self._stop)[index]]  # one element, bounds as a list's

    def __iter__(self):
        return iter(self._materialize())

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, (list, tuple, TokenView)) else other)

    def __repr__(self) -> str:
        return repr(self._materialize())

    def _materialize(self) -> list[int]:
        return self._tokens[self._start:self._stop]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list, or a TokenView over the request's tokens
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Text and tokens added since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
