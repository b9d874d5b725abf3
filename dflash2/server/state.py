"""ServerState: what every HTTP handler shares: the engine (its process or thread), the config, the tokenizer.

Handlers tokenize on the event loop (the tokenizer is read-only once loaded; the engine process sends a copy
of its own when it is ready) and hand token ids to the engine, so the engine never waits for text processing.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from dflash2.server.config import ServerConfig
from dflash2.server.engine_loop import EngineInfo
from dflash2.server.engine_process import EngineProcess
from dflash2.server.engine_thread import EngineThread
from dflash2.server.protocol import BadRequest, ChatMessage


class NotReady(Exception):
    """The model is still loading (503)."""


class ServerState:
    def __init__(self, config: ServerConfig, engine: EngineThread | EngineProcess, registry: CollectorRegistry) -> None:
        self.config = config
        self.engine = engine
        self.registry = registry
        self.started_at = time.time()

    # -- model ---------------------------------------------------------------------------------------
    def require_ready(self) -> EngineInfo:
        if not self.engine.ready:
            raise NotReady("the model is still loading")
        assert self.engine.info is not None
        return self.engine.info

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.require_ready().model_name

    def check_model(self, requested: str | None) -> str:
        """The served name, if `requested` names this model (or is absent); else a 400."""
        engine = self.require_ready()
        known = {self.model_name, engine.model_name, *self.config.model_aliases}
        if requested is not None and requested not in known:
            raise BadRequest(f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        return self.model_name

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.require_ready().tokenizer
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send token ids")
        return tokenizer

    # -- prompts -------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> dict[str, Any]:
        """{"prompt": text or None, "prompt_token_ids": ids} as the engine takes it."""
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("the prompt is empty", param="prompt")
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        return {"prompt": None, "prompt_token_ids": list(prompt)}

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> dict[str, Any]:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("this model has no chat template: use /v1/completions", param="messages")
        conversation = [m.as_template_input() for m in messages]
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's error
            raise BadRequest(f"the chat template rejected the messages: {e}", param="messages") from None
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

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
