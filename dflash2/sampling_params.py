"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash2.structured_outputs import StructuredOutputsParams

MAX_PRIORITY = 65535
MAX_INT32 = 2**31 - 1  # the largest token count, top_k, logprobs or token id a request may name
MAX_SAMPLES = 1024  # n and best_of at most (the server's --max-n bounds them further)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 makes it all but certain
MAX_TEMPERATURE = 100.0  # far past where the distribution is flat; keeps logits / temperature finite
# logits * or / the penalty stay finite in float32 (|logit| < 1e4 at most, times 100); 1e-300 made every
# penalized logit +-inf and the row degenerate (token 0 over and over)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed seed, as vLLM (torch's generators take these)


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
    # n samples of the prompt (prefilled once; the others reuse its KV pages); best_of: that many are drawn and
    # the n with the highest cumulative logprob kept (None: n)
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # the output must match a JSON schema, a regex, a choice or a grammar (a dict of StructuredOutputsParams'
    # fields is taken too)
    structured_outputs: StructuredOutputsParams | None = None
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
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field out of range (each message starts with the field's name)."""
        _check(_int(self.n) and 1 <= self.n <= MAX_SAMPLES, f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        _check(self.best_of is None or (_int(self.best_of) and self.n <= self.best_of <= MAX_SAMPLES),
               f"best_of must be in [n, {MAX_SAMPLES}] (n is {self.n}), got {self.best_of}")
        self._check_logit_bias()
        if self.structured_outputs is not None:  # (its schema or grammar is parsed when the request is added)
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   "structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.kind  # noqa: B018 - exactly one kind, else ValueError
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(_int(self.top_k) and 0 <= self.top_k <= MAX_INT32,
               f"top_k must be -1, 0 (disabled) or a positive integer up to the vocabulary, got {self.top_k}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check(self.seed is None or (_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        _check(self.max_tokens is None or (_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32),
               f"max_tokens must be in [1, {MAX_INT32}], got {self.max_tokens}")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32,
               f"min_tokens must be in [0, {MAX_INT32}], got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_int(value) and 0 <= value <= MAX_INT32),
                   f"{name} must be >= 0, got {value}")
        _check(self.output_kind in OUTPUT_KINDS,
               f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop must be non-empty strings")
        _check(all(_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids or []),
               "stop_token_ids must be non-negative integers")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias must be a mapping of token ids to biases")
        for token_id, value in (bias or {}).items():
            _check(_int(token_id) and 0 <= token_id <= MAX_INT32,
                   f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            _check(_finite(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1],
                   f"logit_bias values must be in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}], got {value} "
                   f"for token {token_id}")

    @property
    def num_samples(self) -> int:
        """How many sequences the request draws (best_of, else n)."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalty(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the request's token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def edits_logits(self) -> bool:
        """A penalty or a logit bias changes this request's logits before sampling."""
        return self.has_penalty or bool(self.logit_bias)

    @property
    def final_only(self) -> bool:
        return self.output_kind == "final_only"


OUTPUT_KINDS = ("every_step", "final_only")


def check_against_vocab(params: SamplingParams, vocab_size: int, max_logprobs: int | None = None) -> None:
    """The checks that need the model: top_k, logprobs and stop_token_ids within the vocabulary, logprobs and
    prompt_logprobs at most `max_logprobs` (None: the vocabulary). ValueError naming the field."""
    _check(params.top_k <= vocab_size, f"top_k must be at most the vocabulary size {vocab_size}, got {params.top_k}")
    limit = vocab_size if max_logprobs is None else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        _check(value is None or value <= limit, f"{name} must be at most {limit}, got {value}")
    _check(all(t < vocab_size for t in params.stop_token_ids or []), f"stop_token_ids must be in [0, {vocab_size})")
    outside = [t for t in params.logit_bias or {} if t >= vocab_size]
    _check(not outside, f"logit_bias keys must be token ids in [0, {vocab_size}), got {outside[0] if outside else None}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_float(name: str, value: object, low: float, high: float) -> None:
    """NaN and infinities fail too (a NaN compares false)."""
    _check(_finite(value) and low <= value <= high, f"{name} must be in [{low:g}, {high:g}], got {value}")
