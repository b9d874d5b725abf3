"""The fields of OpenAI's and vLLM's APIs that ask for what this server does not have, and the values of each
that ask for nothing (absent, empty, the default): field -> (those values, why another value is refused).

protocol.py declares each field and answers any other value with a 400 naming it, so a client written for
OpenAI or vLLM never gets a silent wrong answer (beam search answered by one greedy sample).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

def _absent(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _false(value: Any) -> bool:
    return value is None or value is False


def _one_of(*fine: Any) -> Callable[[Any], bool]:
    """None or one of `fine` (1.0 counts as 1; True never as 1)."""
    return lambda value: value is None or any(value == f and isinstance(value, bool) == isinstance(f, bool)
                                              for f in fine)


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_false, "beam search is not supported"),
    "length_penalty": (_one_of(1), "length_penalty (beam search) is not supported"),
    "allowed_token_ids": (_absent, "allowed_token_ids is not supported"),
    "bad_words": (_absent, "bad_words is not supported"),
    "logits_processors": (_absent, "logits_processors is not supported"),
    "guided_whitespace_pattern": (_absent, "guided_whitespace_pattern is not supported (JSON comes out compact)"),
    "spaces_between_special_tokens": (_one_of(True), "spaces_between_special_tokens=false is not supported"),
    "return_tokens_as_token_ids": (_false, "return_tokens_as_token_ids is not supported"),
    "return_token_ids": (_false, "return_token_ids is not supported"),
    "cache_salt": (_absent, "cache_salt is not supported"),
    "kv_transfer_params": (_absent, "kv_transfer_params is not supported"),
    "vllm_xargs": (_absent, "vllm_xargs is not supported"),
}
COMPLETION_UNSUPPORTED = {
    "prompt_embeds": (_absent, "prompt_embeds is not supported"),
}
CHAT_UNSUPPORTED = {
    "functions": (_absent, "functions (the legacy function calling) are not supported: use tools"),
    "function_call": (_one_of("none", "auto"), "function_call (the legacy function calling) is not supported: use "
                                               "tool_choice"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "reasoning_effort": (_absent, "reasoning_effort is not supported by this model"),
    "verbosity": (_absent, "verbosity is not supported by this model"),
    "store": (_false, "store is not supported (completions are not stored)"),
    "service_tier": (_one_of("auto", "default"), "only service_tier \"auto\" or \"default\" is supported"),
    "echo": (_false, "echo is not supported in chat completions"),
    "documents": (_absent, "documents are not supported"),
    "chat_template": (_absent, "a chat template of the request's own is not supported"),
    "mm_processor_kwargs": (_absent, "multimodal input is not supported"),
    "media_io_kwargs": (_absent, "multimodal input is not supported"),
}
# apply_chat_template's own parameters (and the template's `messages`): not template variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
