"""Request bodies of the HTTP API (pydantic, strict types) and their mapping to SamplingParams.

Field names follow OpenAI, plus vLLM's extra sampling fields and our `priority`. Unknown fields are
ignored, as OpenAI-compatible servers do; a field we know but cannot honour (n > 1, tools, logit_bias)
is a 400, never silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash2.sampling_params import MAX_PRIORITY, SamplingParams


class BadRequest(ValueError):
    """A client error, answered as 400 with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status_code = status_code


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=0, le=MAX_PRIORITY)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this body; BadRequest naming the first bad value."""
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", param="logit_bias")
        optional = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                      ("top_k", self.top_k), ("min_p", self.min_p),
                                      ("repetition_penalty", self.repetition_penalty)) if v is not None}
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs, **optional)
        except ValueError as e:
            raise BadRequest(str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.best_of not in (None, 1):
            raise BadRequest("best_of must be 1", param="best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (OpenAI takes one prompt or a batch)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if not all(isinstance(part, TextPart) for part in content):
                raise BadRequest("only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        if self.tools:
            raise BadRequest("tools are not supported", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest(f"response_format {self.response_format.type!r} is not supported",
                             param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_SamplingFields):
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    stream: bool = False
    logprobs: int | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise BadRequest("give exactly one of prompt and prompt_token_ids", param="prompt")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[_Body], data: Any) -> Any:
    """Validate a decoded JSON body; BadRequest naming the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(*_describe(e)) from None
    if hasattr(body, "check"):
        body.check()
    return body


def _describe(error: ValidationError) -> tuple[str, str | None]:
    errors = error.errors()
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else None
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if first["type"] == "missing":
        return f"'{field}' is required", field
    if len(same_field) > 1:  # a union: every alternative failed
        value = first.get("input")
        return f"'{field}' has the wrong type ({type(value).__name__})", field
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"'{where}': {first['msg']}", field
