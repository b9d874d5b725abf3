from __future__ import annotations

import pytest

from dflash2 import LLM


@pytest.fixture(scope="session")
def bundled_llm() -> LLM:
    """The bundled model as a user gets it: the GGUF's own precision (Q4_1 as int4, Q8_0 as int8)."""
    return LLM(max_num_seqs=16)


@pytest.fixture(scope="session")
def bundled_llm_float() -> LLM:
    """The float path (`dtype="float32"`), token-exact with transformers."""
    return LLM(dtype="float32", max_num_seqs=16)


def _convert(tmp_path_factory, name: str, *flags: str) -> str:
    from dflash2.cli.main import main as dflash2_main

    out = str(tmp_path_factory.mktemp("converted") / name)
    assert dflash2_main(["convert", "--output-path", out, "--no-progress", *flags]) == 0
    return out


@pytest.fixture(scope="session")
def converted_int8(tmp_path_factory) -> str:
    """The bundled model converted to int8 weights (about 15 s, once a session)."""
    return _convert(tmp_path_factory, "int8", "--dtype", "int8")


@pytest.fixture(scope="session")
def converted_mixed(tmp_path_factory) -> str:
    """The bundled model converted to the mixed 8/4/8/6 weights with int8 KV."""
    return _convert(tmp_path_factory, "mixed", "--embed-quant", "8", "--qkv-quant", "4", "--o-proj-quant", "8",
                    "--ffn-quant", "6", "--kv-quant", "int8")


@pytest.fixture(scope="session")
def real_server():
    """One real `dflash2-server` on the bundled model for the server test modules (started once a session), on the
    float path: its answers are compared token for token with the offline engine's (bundled_llm_float). On the
    default path (int4 kernels for a few rows, bf16 copies from 16) the numerics of a prompt depend on how many of
    its tokens a step computes, so a prefix-cache hit may flip a near tie; the servers of the other modules run the
    default path."""
    from tests.integration.server_process import API_KEY, ServerProcess

    server = ServerProcess("--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16", "--api-key", API_KEY,
                           "--max-request-bytes", "65536", "--disable-log-stats").start()
    yield server
    server.cleanup()
