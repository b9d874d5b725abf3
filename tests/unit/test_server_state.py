"""ServerState's prompts: tokenized on a worker thread, and a text too long for the context by its byte count
refused before it is tokenized (issue 40: a 1 MB prompt stalled every stream for 1.25 s); unknown models 404."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from dflash2.server.config import ServerConfig
from dflash2.server.engine_messages import EngineInfo, ModelInfo
from dflash2.server.protocol import BadRequest
from dflash2.server.state import PromptBound, ServerState


class FakeTokenizer:
    """Every token covers at most 10 bytes ('x' * 10 is the longest); encode: one id a character."""

    def __init__(self, normalizer: dict | None = None) -> None:
        self.encoded_on: list[str] = []
        self.backend_tokenizer = SimpleNamespace(to_str=lambda: json.dumps({"normalizer": normalizer}))

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "x" * 10: 1, "é": 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_on.append(threading.current_thread().name)
        return [0] * len(text)


def state_with(tokenizer: FakeTokenizer, max_model_len: int = 100, names: tuple[str, ...] = ("m",)) -> ServerState:
    info = EngineInfo({name: ModelInfo(name, 1000, max_model_len, tokenizer, "fp32", "fp32") for name in names})
    engine = SimpleNamespace(ready=True, info=info)
    return ServerState(ServerConfig(), engine, registry=None)  # type: ignore[arg-type]


def model_of(tokenizer: FakeTokenizer, max_model_len: int = 100):
    return state_with(tokenizer, max_model_len).check_model(None)


def test_text_is_tokenized_on_a_worker_thread():
    tokenizer = FakeTokenizer()
    prompts = asyncio.run(model_of(tokenizer).encode(["hello", [5, 6]]))
    assert prompts == [{"prompt": "hello", "prompt_token_ids": [0] * 5}, {"prompt": None, "prompt_token_ids": [5, 6]}]
    assert tokenizer.encoded_on and threading.main_thread().name not in tokenizer.encoded_on


def test_a_prompt_too_long_by_its_bytes_is_refused_before_it_is_tokenized():
    tokenizer = FakeTokenizer()
    model = model_of(tokenizer, max_model_len=100)
    with pytest.raises(BadRequest, match="1000 bytes, so at least 100 tokens, but max_model_len is 100"):
        asyncio.run(model.encode(["y" * 1000]))
    assert tokenizer.encoded_on == []
    asyncio.run(model.encode(["y" * 990]))  # at least 99 tokens: it could fit, so it is tokenized
    assert len(tokenizer.encoded_on) == 1
    asyncio.run(model.encode(["y" * 5000], check_length=False))  # to be truncated: tokenized whole
    assert len(tokenizer.encoded_on) == 2


@pytest.mark.parametrize("normalizer, shrink", [
    (None, 1),
    ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                          {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}, 1),
    ({"type": "NFKC"}, 4),
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}, 16),
    ({"type": "BertNormalizer"}, 0),  # strips control characters: no bound on how far text shrinks
    ({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, 0),
])
def test_the_byte_bound_allows_for_what_the_normalizer_may_remove(normalizer, shrink):
    bound = PromptBound.of(FakeTokenizer(normalizer), 100)
    assert bound.max_bytes_per_token == 10 * shrink


def test_an_unknown_model_is_404_model_not_found():
    with pytest.raises(BadRequest) as error:
        state_with(FakeTokenizer()).check_model("gpt-4")
    assert (error.value.status_code, error.value.code, error.value.param) == (404, "model_not_found", "model")


def test_with_several_models_a_request_names_one():
    state = state_with(FakeTokenizer(), names=("small", "large"))
    assert state.check_model("large").name == "large" and state.check_model("small").engine_name == "small"
    with pytest.raises(BadRequest, match=r"several models \(small, large\): name one in `model`") as error:
        state.check_model(None)
    assert error.value.status_code == 400
    with pytest.raises(BadRequest, match="'tiny' does not exist; this server serves 'small', 'large'") as error:
        state.check_model("tiny")
    assert error.value.code == "model_not_found"
