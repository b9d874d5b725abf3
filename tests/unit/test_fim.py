"""Fill in the middle: the model's FIM tokens found by name, and the prefix-suffix-middle prompt built around them."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash2.server.fim import fim_prompt, fim_token_ids

WORDS = ["<s>", "def", "add", "(", ")", ":", "return", "a", "b", "+"]


def tokenizer(special: list[str], bos: bool = False) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS + special)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", additional_special_tokens=special)


def test_the_first_family_whose_three_tokens_are_special_tokens_is_used():
    starcoder = tokenizer(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    assert fim_token_ids(starcoder) == (10, 11, 12)
    qwen = tokenizer(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<fim_prefix>"])
    assert fim_token_ids(qwen) == (10, 11, 12)
    assert fim_token_ids(tokenizer(["<fim_prefix>", "<fim_suffix>"])) is None  # no middle token
    assert fim_token_ids(tokenizer([])) is None and fim_token_ids(None) is None


def test_the_prompt_is_prefix_prompt_suffix_suffix_middle_after_the_bos():
    fim = tokenizer(["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], bos=True)
    tokens = fim_token_ids(fim)
    prompt_ids = fim.encode("def add ( a , b ) :", add_special_tokens=False)
    assert fim_prompt(fim, tokens, prompt_ids, "return a + b") == [0, 10, *prompt_ids, 11,
                                                                   *fim.encode("return a + b",
                                                                               add_special_tokens=False), 12]


def test_the_server_wraps_each_prompt_or_answers_400_for_a_model_without_fim():
    import asyncio

    import pytest

    from dflash2.server.config import ServerConfig
    from dflash2.server.engine_messages import ModelInfo
    from dflash2.server.protocol import BadRequest
    from dflash2.server.state import ModelHandle

    def handle(tokenizer_object) -> ModelHandle:
        return ModelHandle(ModelInfo("m", 16, 64, tokenizer_object, "fp32", "fp32"), "m", ServerConfig())

    starcoder = tokenizer(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    prompts = [{"prompt": "def add", "prompt_token_ids": [1, 2]}, {"prompt": None, "prompt_token_ids": [3]}]
    wrapped = asyncio.run(handle(starcoder).fill_in_the_middle(prompts, "return a"))
    assert wrapped == [{"prompt": "def add", "prompt_token_ids": [10, 1, 2, 11, 6, 7, 12]},
                       {"prompt": None, "prompt_token_ids": [10, 3, 11, 6, 7, 12]}]
    with pytest.raises(BadRequest, match="has none") as error:
        asyncio.run(handle(tokenizer([])).fill_in_the_middle(prompts, "x"))
    assert error.value.param == "suffix"
