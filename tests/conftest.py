from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import build_tiny_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama saved to disk once per test session (tests.tiny_models)."""
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="session")
def hf_bundled():
    """transformers' own load of the bundled GGUF in float32: the reference of the integration tests and of
    tests/unit/test_gguf_loader.py's weights (about 20 s, once a session)."""
    from transformers import AutoModelForCausalLM

    from dflash2.loading.tokenizer import bundled_model_path, quiet_transformers

    path = bundled_model_path()
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """A tiny random Qwen2 saved to disk once per test session."""
    directory = str(tmp_path_factory.mktemp("tiny-qwen2"))
    build_tiny_model("qwen2", directory)
    return directory

