"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_PRIORITY = 65535


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token
    # "every_step": Engine.step() returns an output for this request as it makes tokens (streaming: every step,
    # or every EngineConfig.stream_interval tokens);
    # "final_only": only when it finishes (LLM.generate; vLLM's RequestOutputKind.FINAL_ONLY)
    output_kind: str = "every_step"
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check(self.n == 1, f"n must be 1 (parallel sampling is not supported), got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
               f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        _check(self.output_kind in OUTPUT_KINDS,
               f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
               "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalty(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the request's token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def final_only(self) -> bool:
        return self.output_kind == "final_only"


OUTPUT_KINDS = ("every_step", "final_only")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
