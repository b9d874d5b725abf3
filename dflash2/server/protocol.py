"""Request bodies of the HTTP API (pydantic, strict types) and their mapping to SamplingParams.

Field names follow OpenAI, plus vLLM's extra fields and our `priority`. Every field of either API is declared
here, and each is honoured or refused:
- honoured: mapped onto SamplingParams or the prompt (prompt_logprobs, echo, add_special_tokens, ...);
- accepted because it asks for nothing that changes the answer (user, metadata, prompt_cache_key, ...);
- refused with a 400 naming it when it asks for what this server lacks (beam search, audio, ...; UNSUPPORTED): a client written for OpenAI or vLLM never gets a silent wrong answer.
A field of neither API passes, and the server log names it once.

Types are strict (body.py: the base model, parse_body()). Ranges are SamplingParams.validate()'s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from dflash2.sampling_params import MAX_PRIORITY, SamplingParams, check_against_vocab
from dflash2.structured_outputs import StructuredOutputsParams
from dflash2.server.bad_request import BadRequest
from dflash2.server.body import Body, Int
from dflash2.server.config import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST
from dflash2.server.structured_fields import structured_outputs_of
from dflash2.server.tools import check_message_tool_calls
from dflash2.server.unsupported import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, RESERVED_TEMPLATE_KWARGS, UNSUPPORTED


@dataclass(frozen=True)
class RequestLimits:
    """What the server allows one request (ServerConfig's flags and the model's vocabulary)."""

    vocab_size: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_n: int = DEFAULT_MAX_N  # n and best_of at most


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted: no padding field is ever sent
    continuous_usage_stats: bool = False

    def check(self) -> None:
        if self.continuous_usage_stats:
            raise BadRequest("'stream_options.continuous_usage_stats' is not supported", param="stream_options")


class _SamplingFields(Body):
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = UNSUPPORTED

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted: an end-user id (for the client's own abuse tracking)
    # vLLM's extra fields
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Int | None = Field(None, ge=1)
    prompt_logprobs: Int | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default
    request_id: str | None = Field(None, max_length=256)  # the response's id (after its prefix)
    priority: Int = Field(0, ge=0, le=MAX_PRIORITY)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    best_of: Int | None = None
    # structured output (structured_fields.py)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # refused unless absent or harmless (UNSUPPORTED)
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    stream: bool = False

    def check(self) -> None:
        super().check()
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is only returned by requests that do not stream", param="prompt_logprobs")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise BadRequest("best_of > n is only answered to requests that do not stream (the best are known at "
                             "the end)", param="best_of")

    def logprob_fields(self) -> dict[str, int | None]:
        """The fields asking for top logprobs, as the client named them."""
        return {"prompt_logprobs": self.prompt_logprobs}

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs asked for each prompt token."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, limits: RequestLimits,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this body; BadRequest naming the first bad value. `structured_outputs`: the
        handler's own (a tool call it must force), in place of the body's."""
        most = min(limits.max_logprobs, limits.vocab_size)
        for name, value in self.logprob_fields().items():
            if value is not None and not 0 <= value <= most:
                raise BadRequest(f"{name} must be in [0, {most}] (the server's --max-logprobs), got {value}",
                                 param=name)
        for name in ("n", "best_of"):
            value = getattr(self, name)
            if value is not None and value > limits.max_n:
                raise BadRequest(f"{name} must be at most {limits.max_n} (the server's --max-n), got {value}",
                                 param=name)
        structured = structured_outputs_of(self)
        if structured is not None and structured_outputs is not None:
            raise BadRequest("a required or named tool call is itself structured output: drop the other one",
                             param="tool_choice")
        optional = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                      ("top_k", self.top_k), ("min_p", self.min_p),
                                      ("repetition_penalty", self.repetition_penalty)) if v is not None}
        try:
            params = SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=self.num_prompt_logprobs, best_of=self.best_of, logit_bias=self.token_biases(),
                structured_outputs=structured or structured_outputs, **optional)
            check_against_vocab(params, limits.vocab_size, limits.max_logprobs)
        except ValueError as e:
            raise BadRequest(str(e), param=str(e).split(" ", 1)[0]) from None
        return params


    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (OpenAI sends them as strings)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            try:
                biases[int(key)] = value
            except ValueError:
                raise BadRequest(f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias") from None
        return biases


class CompletionRequest(_SamplingFields):
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {**UNSUPPORTED, **COMPLETION_UNSUPPORTED}

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    stream_options: StreamOptions | None = None
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None  # fill in the middle (fim.py), for models that have it
    prompt_embeds: Any = None

    def check(self) -> None:
        super().check()
        if self.echo and self.logprobs is not None and self.stream:
            raise BadRequest("echo with logprobs is only answered to requests that do not stream", param="echo")

    def logprob_fields(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, **super().logprob_fields()}

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs asked for each prompt token: prompt_logprobs, or with echo, logprobs (as vLLM)."""
        if self.prompt_logprobs is not None or not self.echo:
            return self.prompt_logprobs
        return self.logprobs

    def prompts(self, limits: RequestLimits) -> list[str | list[int]]:
        """The prompt as a list of prompts (OpenAI takes one prompt or a batch)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        if len(prompt) > limits.max_prompts_per_request:
            raise BadRequest(f"the request has {len(prompt)} prompts; the server takes at most "
                             f"{limits.max_prompts_per_request} a request (--max-prompts-per-request)", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: str
    content: str | list[TextPart] | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None  # accepted: an assistant's refusal, which the template does not show
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (tools.py renders them)
    tool_call_id: str | None = None  # a tool message's answer to that call
    # refused unless absent: the legacy function calling and audio (text only)
    function_call: Any = None
    audio: Any = None

    def as_template_input(self) -> dict[str, Any]:
        for name in ("function_call", "audio"):
            if getattr(self, name) not in (None, [], "", {}):
                raise BadRequest(f"messages with '{name}' are not supported (text only; tool_calls for tools)",
                                 param="messages")
        content = self.content
        if isinstance(content, list):
            if not all(isinstance(part, TextPart) for part in content):
                raise BadRequest("only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = check_message_tool_calls(self.tool_calls)
        return message


class ChatCompletionRequest(_SamplingFields):
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {**UNSUPPORTED, **CHAT_UNSUPPORTED}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted: they ask for nothing that changes the answer
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None  # false: the first tool call only
    prompt_cache_key: str | None = None  # the prefix cache needs no hint
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    tools: list[dict[str, Any]] | None = None  # tools.py
    tool_choice: str | dict[str, Any] | None = None
    # refused unless absent or harmless (CHAT_UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    service_tier: Any = None
    echo: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(self.chat_template_kwargs or {}))
        if reserved:
            raise BadRequest(f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")

    def logprob_fields(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs, **super().logprob_fields()}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_SamplingFields):
    prompt: str | None = None
    prompt_token_ids: list[Int] | None = None
    max_tokens: Int | None = 16
    logprobs: Int | None = None

    def check(self) -> None:
        super().check()
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise BadRequest("give exactly one of prompt and prompt_token_ids", param="prompt")
        for name in ("n", "best_of"):
            if (getattr(self, name) or 1) != 1:
                raise BadRequest(f"/generate returns one sample: {name} must be 1 (use /v1/completions for more)",
                                 param=name)

    def logprob_fields(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, **super().logprob_fields()}


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Int]
