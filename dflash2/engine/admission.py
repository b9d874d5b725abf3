"""Request admission: a prompt (text, token ids, or a dict of either) to token ids, and the checks a request passes
before it is queued (sampling ranges, the model's vocabulary, max_model_len, the pool's room for the model).
Each failure is a ValueError saying what is wrong with the request; nothing is queued then."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash2.engine.served_model import ServedModel
from dflash2.sampling_params import SamplingParams, check_against_vocab

PromptInput = str | list[int] | dict[str, Any]


def tokenize(served: ServedModel, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and token ids."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(served, prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if served.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
        return prompt, served.tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, check_token_ids(served, prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def check_token_ids(served: ServedModel, token_ids: Sequence[Any]) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError("prompt_token_ids must be a non-empty list of token ids")
    vocab = served.model.arch.vocab_size
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab})")
    return list(token_ids)


def validate(served: ServedModel, token_ids: list[int], params: SamplingParams, pool_num_pages: int) -> None:
    """The request fits the model: valid sampling parameters, a prompt that leaves a token to generate, and no
    more KV than the pool (of `pool_num_pages`) holds for the model."""
    params.validate()
    check_against_vocab(params, served.model.arch.vocab_size)
    if len(token_ids) >= served.max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {served.max_model_len} "
                         f"(at least one token must be left to generate)")
    total = min(served.max_model_len, len(token_ids) + (params.max_tokens or served.max_model_len))
    limit = pool_num_pages
    if served.spec.max_pool_share is not None:
        limit = max(1, int(served.spec.max_pool_share * pool_num_pages))
    if served.kv.num_pages_for(total) > limit:
        raise ValueError(f"the request needs up to {total} tokens of KV cache, more than the whole pool holds "
                         f"for this model ({limit * served.kv.tokens_per_page})")
