"""Fill in the middle: /v1/completions' `suffix`, for models whose vocabulary has fill-in-the-middle tokens.

    prompt + suffix  ──►  [BOS] PREFIX_TOKEN prompt SUFFIX_TOKEN suffix MIDDLE_TOKEN   (prefix-suffix-middle order)
                          the model writes the middle; the response's text is that middle

The three tokens are looked up by name, in the families' spellings below; the first family whose three tokens are
all special tokens of the tokenizer wins. A model with none of them answers a request with a suffix with a 400.
"""
from __future__ import annotations

from typing import Any

FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, SantaCoder, Granite code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # Code Llama
)


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the tokenizer's fill-in-the-middle tokens; None if it has none."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", ())) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    for names in FIM_TOKENS:
        if all(name in vocab and (name in special or name.startswith("▁<")) for name in names):
            prefix, suffix, middle = (vocab[name] for name in names)
            return prefix, suffix, middle
    return None


def fim_prompt(tokenizer: Any, tokens: tuple[int, int, int], prompt_token_ids: list[int], suffix: str) -> list[int]:
    """The prefix-suffix-middle prompt of a prompt (its ids, without special tokens) and a suffix's text."""
    prefix_id, suffix_id, middle_id = tokens
    bos = tokenizer.encode("", add_special_tokens=True)  # the tokens the tokenizer puts first (BOS), if any
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
    return [*bos, prefix_id, *prompt_token_ids, suffix_id, *suffix_ids, middle_id]
