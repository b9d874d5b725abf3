"""ServerState: what every HTTP handler shares: the engine (its process or thread), the config, the models.

A request's `model` picks a ModelHandle (check_model): that model's tokenizer, limits and prompt checks. Handlers
tokenize on a worker thread (asyncio.to_thread: the tokenizer is read-only once loaded and leaves the GIL while it
works; the engine process sends a copy of each model's when it is ready or loads one), so a long prompt never
stalls the other streams, and hand token ids to the engine, which never waits for text processing. A text prompt
too long for the context by its byte count alone is refused before it is tokenized (PromptBound).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from prometheus_client import CollectorRegistry

from dflash2.server.config import ServerConfig
from dflash2.server.engine_messages import EngineInfo, ModelInfo
from dflash2.server.engine_process import EngineProcess
from dflash2.server.engine_thread import EngineThread
from dflash2.server.fim import fim_prompt, fim_token_ids
from dflash2.server.protocol import BadRequest, ChatMessage, RequestLimits
from dflash2.server.tools import template_messages

logger = logging.getLogger("dflash2.server")


class NotReady(Exception):
    """The model is still loading (503)."""


class ServerState:
    def __init__(self, config: ServerConfig, engine: EngineThread | EngineProcess, registry: CollectorRegistry) -> None:
        self.config = config
        self.engine = engine
        self.registry = registry
        self.started_at = time.time()
        self.draining = False  # SIGTERM / SIGINT: no new requests; those in flight finish (launch.drain)
        self.handing_over = False  # SIGUSR2: a successor took the socket; responses say Connection: close
        self.in_flight = 0  # requests past the guard, not yet answered whole (GuardMiddleware counts them)
        self._handles: dict[int, ModelHandle] = {}  # by id() of the ModelInfo: one handle (and bound) per load

    # -- models --------------------------------------------------------------------------------------
    def require_ready(self) -> EngineInfo:
        if not self.engine.ready:
            raise NotReady("the model is still loading")
        assert self.engine.info is not None
        return self.engine.info

    @property
    def single(self) -> bool:
        """One model, served as before several could be: under --served-model-name or its own name."""
        return len(self.require_ready().models) == 1

    @property
    def model_name(self) -> str:
        """The single model's served name."""
        return self.config.served_model_name or self.require_ready().default.model_name

    def check_model(self, requested: str | None) -> ModelHandle:
        """The model a request names (`model` may be absent when one model is loaded); else a 404, as OpenAI and
        vLLM."""
        engine = self.require_ready()
        if self.single:
            info = engine.default
            known = {self.model_name, info.model_name, *self.config.model_aliases}
            if requested is not None and requested not in known:
                raise BadRequest(f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                                 param="model", code="model_not_found", status_code=404)
            return self._handle(info, self.model_name)
        if requested is None:
            raise BadRequest(f"this server serves several models ({', '.join(engine.models)}): name one in `model`",
                             param="model")
        info = engine.models.get(requested)
        if info is None:
            raise BadRequest(f"the model {requested!r} does not exist; this server serves "
                             f"{', '.join(map(repr, engine.models))}", param="model", code="model_not_found",
                             status_code=404)
        return self._handle(info, requested)

    def _handle(self, info: ModelInfo, served_name: str) -> ModelHandle:
        handle = self._handles.get(id(info))
        if handle is None or handle.info is not info:
            handle = self._handles[id(info)] = ModelHandle(info, served_name, self.config)
        return handle


class ModelHandle:
    """One served model as the HTTP handlers use it: its limits, prompts tokenized on a worker thread, decoding.

    Handlers tokenize on a worker thread (asyncio.to_thread: the tokenizer is read-only once loaded and leaves the
    GIL while it works), so a long prompt never stalls the other streams, and hand token ids to the engine. A text
    prompt too long for the context by its byte count alone is refused before it is tokenized (PromptBound)."""

    def __init__(self, info: ModelInfo, served_name: str, config: ServerConfig) -> None:
        self.info = info
        self.name = served_name  # what responses call it
        self.engine_name = info.model_name  # what the engine calls it
        self.config = config
        self._prompt_bound: PromptBound | None = None

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.info.vocab_size, self.config.max_logprobs, self.config.max_prompts_per_request,
                             self.config.max_n)

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.info.tokenizer
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send token ids")
        return tokenizer

    # -- prompts -------------------------------------------------------------------------------------
    async def encode(self, prompts: list[str | list[int]], add_special_tokens: bool = True,
                     check_length: bool = True) -> list[dict[str, Any]]:
        """{"prompt": text or None, "prompt_token_ids": ids} for each prompt, as the engine takes them; text is
        tokenized on a worker thread. check_length: refuse a text that cannot fit max_model_len before
        tokenizing it (off when the prompt is to be truncated)."""
        if any(not prompt for prompt in prompts):
            raise BadRequest("the prompt is empty", param="prompt")
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        if texts:
            tokenizer, bound = self.tokenizer, self.prompt_bound if check_length else None
            if bound is not None:
                for text in texts:
                    bound.check(text)
            ids = iter(await asyncio.to_thread(
                lambda: [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]))
        return [{"prompt": prompt, "prompt_token_ids": next(ids)} if isinstance(prompt, str)
                else {"prompt": None, "prompt_token_ids": list(prompt)} for prompt in prompts]

    @property
    def chat_template(self) -> str | None:
        """--chat-template's text, else the model's own (None: it has none)."""
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        return None if not template else str(template)

    async def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                          add_special_tokens: bool = False, check_length: bool = True,
                          tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The conversation (and `tools`, server/tools.py) through the chat template, then tokenized; both on a
        worker thread."""
        tokenizer = self.tokenizer
        template = self.chat_template
        if template is None:
            raise BadRequest("this model has no chat template: use /v1/completions (or give the server "
                             "--chat-template)", param="messages")
        conversation = [m.as_template_input() for m in messages]
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
            conversation, tools = template_messages(conversation, tools, template)
        override = self.config.chat_template
        bound = self.prompt_bound if check_length else None

        def render_and_encode() -> dict[str, Any]:
            text = render_chat(tokenizer, conversation, add_generation_prompt, continue_final_message,
                               template_kwargs or {}, tools, override)
            if bound is not None:
                bound.check(text)
            return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}

        return await asyncio.to_thread(render_and_encode)

    async def fill_in_the_middle(self, prompts: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
        """Each prompt (encoded without special tokens) made a fill-in-the-middle prompt around `suffix` (fim.py);
        BadRequest if the model has no fill-in-the-middle tokens."""
        tokenizer = self.tokenizer
        tokens = fim_token_ids(tokenizer)
        if tokens is None:
            raise BadRequest("'suffix' needs a model with a fill-in-the-middle template, and this model has none (no "
                             "fill-in-the-middle tokens in its vocabulary)", param="suffix")
        return await asyncio.to_thread(lambda: [
            {"prompt": p["prompt"], "prompt_token_ids": fim_prompt(tokenizer, tokens, p["prompt_token_ids"], suffix)}
            for p in prompts])

    @property
    def prompt_bound(self) -> PromptBound | None:
        """The byte-count check of text prompts (None: this tokenizer's longest token is not known)."""
        if self._prompt_bound is None:
            self._prompt_bound = PromptBound.of(self.tokenizer, self.info.max_model_len)
        return self._prompt_bound if self._prompt_bound.max_bytes_per_token else None

    def truncate(self, prompts: list[dict[str, Any]], num_tokens: int | None) -> bool:
        """Keep the last `num_tokens` tokens of each prompt; True if any was cut."""
        if num_tokens is None:
            return False
        cut = False
        for prompt in prompts:
            if len(prompt["prompt_token_ids"]) > num_tokens:
                prompt["prompt_token_ids"] = prompt["prompt_token_ids"][-num_tokens:]
                prompt["prompt"] = None
                cut = True
        return cut

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any],
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
    """The chat template's text; BadRequest if the template refuses the conversation (its own message, which
    is written for the client), or fails otherwise (no internal text)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **template_kwargs)
    except TemplateError as e:
        raise BadRequest(f"the chat template rejected the messages: {e}", param="messages") from None
    except Exception:  # noqa: BLE001 - e.g. continue_final_message without a final message
        logger.info("the chat template failed on a request's messages", exc_info=True)
        raise BadRequest("the chat template could not render these messages", param="messages") from None


class PromptBound:
    """A text of B bytes is at least ceil(B / max_bytes_per_token) tokens: no token covers more bytes than the
    vocabulary's longest (its UTF-8 length, an upper bound for byte-level and SentencePiece vocabularies alike),
    times how far the tokenizer's normalizer may shrink the text. A prompt whose bound alone reaches max_model_len
    is refused without being tokenized (a 1 MB prompt took 1.25 s to tokenize)."""

    # Unicode normalization and case folding shrink text by at most 3x (NFKC: 'ℌ', 3 bytes, -> 'H')
    _SHRINKING = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4}

    def __init__(self, max_bytes_per_token: int, max_model_len: int) -> None:
        self.max_bytes_per_token = max_bytes_per_token  # 0: unknown, no check
        self.max_model_len = max_model_len

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> PromptBound:
        try:
            longest = max(len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab())
            normalizer = json.loads(tokenizer.backend_tokenizer.to_str()).get("normalizer")
        except Exception:  # noqa: BLE001 - a tokenizer without these: no byte bound, prompts are tokenized
            return cls(0, max_model_len)
        shrink = cls._shrink(normalizer)
        return cls(longest * shrink if shrink else 0, max_model_len)

    @classmethod
    def _shrink(cls, normalizer: dict[str, Any] | None) -> int:
        """How many times fewer bytes the normalizer may leave of a text (0: unbounded, e.g. stripping)."""
        if normalizer is None:
            return 1
        kind = normalizer.get("type")
        if kind == "Sequence":
            factors = [cls._shrink(n) for n in normalizer.get("normalizers", [])]
            return 0 if 0 in factors else math.prod(factors)
        if kind == "Prepend":
            return 1
        if kind == "Replace":
            pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
            return 1 if pattern is not None and len(content.encode()) >= len(pattern.encode()) else 0
        return cls._SHRINKING.get(kind, 0)

    def check(self, text: str) -> None:
        num_bytes = len(text.encode("utf-8"))
        least = -(-num_bytes // self.max_bytes_per_token)
        if least >= self.max_model_len:
            raise BadRequest(f"the prompt has {num_bytes} bytes, so at least {least} tokens, but max_model_len is "
                             f"{self.max_model_len} (at least one token must be left to generate)", param="prompt")
