"""The founding scenario on tiny models (issue 45): three mixture-of-experts models of 8 experts, their experts
quantized at 4, 6 and 8 bits by `dflash2 convert`, in one real server sharing one KV pool, talked to by name with
the official openai client at different priorities: each answers exactly as it does alone."""
from __future__ import annotations

import concurrent.futures
import json

import openai
import pytest

from dflash2 import LLM, SamplingParams
from dflash2.cli.main import main as dflash2_main
from tests.integration.server_process import ServerProcess
from tests.tiny_models import build_tiny_model
from tests.unit.test_convert_tiny import save_byte_tokenizer

MODELS = {"mixtral-int4": ("mixtral", "4"), "qwen2-moe-int6": ("qwen2_moe", "6"), "olmoe-int8": ("olmoe", "8")}
PROMPTS = ["Experts route tokens", "A tiny model says", "one two three"]
MAX_TOKENS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe-server")
    paths = {}
    for name, (arch, bits) in MODELS.items():
        source = str(root / f"{arch}-source")
        build_tiny_model(arch, source)
        save_byte_tokenizer(source)
        paths[name] = str(root / name)
        assert dflash2_main(["convert", "--model-path", source, "--output-path", paths[name], "--no-progress",
                             "--expert-quant", bits]) == 0
    return paths


@pytest.fixture(scope="module")
def alone(paths) -> dict[str, list[str]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = {}
    for name, path in paths.items():
        with LLM(path, max_num_seqs=8, max_model_len=256) as llm:
            outputs[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    return outputs


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    config = tmp_path_factory.mktemp("moe-models") / "models.json"
    config.write_text(json.dumps({"models": [{"name": name, "path": path} for name, path in paths.items()]}))
    process = ServerProcess("--models-config", str(config), "--max-num-seqs", "8", "--max-model-len", "256",
                            "--disable-log-stats").start()
    yield process
    process.cleanup()


def test_three_moe_models_at_three_expert_widths_each_answer_as_alone(server, alone):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def complete(job: tuple[str, int, int]) -> str:
        model, index, priority = job
        completion = client.completions.create(model=model, prompt=PROMPTS[index], max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True, "priority": priority})
        assert completion.model == model and completion.usage.completion_tokens == MAX_TOKENS
        return completion.choices[0].text

    jobs = [(model, index, priority) for index in range(len(PROMPTS)) for priority, model in enumerate(alone)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(complete, jobs))
    for (model, index, _), text in zip(jobs, results):
        assert text == alone[model][index], (model, PROMPTS[index])
    listed = {m.id: m.model_extra["weights"] for m in client.models.list().data}
    assert listed == {"mixtral-int4": "embed 16, qkv 16, o_proj 16, ffn 16, lm_head 16, experts 4 bits",
                      "qwen2-moe-int6": "embed 16, qkv 16, o_proj 16, ffn 16, lm_head 16, experts 6 bits",
                      "olmoe-int8": "embed 16, qkv 16, o_proj 16, ffn 16, lm_head 16, experts 8 bits"}
    assert server.metric("dflash2_kv_cache_used_pages") == 0
