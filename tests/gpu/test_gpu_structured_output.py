"""On a CUDA device: structured output through the GPU path (overlapped steps, CUDA graphs, masks copied to the
device without a sync): every guided row of a batch that mixes guided and plain rows matches its constraint.

The model is a tiny Llama with dummy weights over a character-level tokenizer written here (a dummy preset has
no tokenizer and the bundled model does not travel to the GPU machine)."""
from __future__ import annotations

import json
import re
import string

import pytest
import torch

from dflash2 import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["name", "population"], "additionalProperties": False}


def write_char_model(directory) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()  # the characters joined as they are (no spaces between tokens)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": len(vocab), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 1024, "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 1}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    directory = tmp_path_factory.mktemp("char_model")
    write_char_model(directory)
    engine = LLM(str(directory), load_format="dummy", tokenizer=str(directory), dtype="bfloat16",
                 kv_cache_memory="256MiB", max_num_seqs=32)
    assert engine.engine.device.type == "cuda"
    yield engine
    engine.close()


def test_guided_rows_match_their_constraints_beside_plain_rows(llm):
    prompts = [f"city {i}: " for i in range(24)]
    schema = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    regex = SamplingParams(temperature=0, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} has [0-9]{1,3} parks"))
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(choice=["Paris", "Tokyo", "Lima"]))
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    params = [(schema, regex, sampled, plain)[i % 4] for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        kind = i % 4
        if kind == 3:
            assert len(completion.token_ids) == 32
            continue
        assert completion.finish_reason == "stop", (i, completion.text)
        if kind == 0:
            value = json.loads(completion.text)
            assert set(value) == {"name", "population"} and len(value["name"]) <= 12
            assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999999
        elif kind == 1:
            assert re.fullmatch(r"[A-Z][a-z]{2,8} has [0-9]{1,3} parks", completion.text), completion.text
        else:
            assert completion.text in ("Paris", "Tokyo", "Lima")
