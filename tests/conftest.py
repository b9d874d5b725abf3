from __future__ import annotations

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
def tiny_qwen2(tmp_path_factory) -> str:
    """A tiny random Qwen2 saved to disk once per test session."""
    directory = str(tmp_path_factory.mktemp("tiny-qwen2"))
    build_tiny_model("qwen2", directory)
    return directory

