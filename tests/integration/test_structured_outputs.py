"""Structured output offline on the bundled model: each kind's output matches its constraint, overlapped steps (the
GPU's way: masks built before the previous token is committed) give the same tokens as plain ones, and a bad
schema is refused before anything runs."""
from __future__ import annotations

import json
import re

import pytest

from dflash2 import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Describe a city in JSON with its name and population."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["name", "population"], "additionalProperties": False}
SHORT = {**SCHEMA, "properties": {"name": {"type": "string", "maxLength": 12},
                                  "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


def run(llm: LLM, constraint: StructuredOutputsParams, **params) -> list[str]:
    params = {"temperature": 0, "max_tokens": 48, **params}
    output = llm.chat(CHAT, SamplingParams(structured_outputs=constraint, **params))[0]
    assert all(c.finish_reason == "stop" for c in output.outputs), output.outputs
    return [c.text for c in output.outputs]


def test_each_kind_of_constraint_holds(bundled_llm_float):
    llm = bundled_llm_float
    [text] = run(llm, StructuredOutputsParams(json=SCHEMA))
    assert set(json.loads(text)) == {"name", "population"} and isinstance(json.loads(text)["population"], int)
    [text] = run(llm, StructuredOutputsParams(json_object=True))
    assert isinstance(json.loads(text), dict)
    [text] = run(llm, StructuredOutputsParams(choice=["Paris", "Tokyo", "Lima"]))
    assert text in ("Paris", "Tokyo", "Lima")
    [text] = run(llm, StructuredOutputsParams(regex=r"[A-Z][a-z]+ has [0-9]{1,3} parks"))
    assert re.fullmatch(r"[A-Z][a-z]+ has [0-9]{1,3} parks", text)
    [text] = run(llm, StructuredOutputsParams(grammar='root ::= "City: " name\nname ::= [A-Z] [a-z]+'), max_tokens=12)
    assert re.fullmatch(r"City: [A-Z][a-z]+", text)
    texts = run(llm, StructuredOutputsParams(json=SHORT), temperature=1.0, seed=4, n=3)
    values = [json.loads(t) for t in texts]
    assert len({json.dumps(v) for v in values}) == 3
    assert all(len(v["name"]) <= 12 and 0 <= v["population"] <= 99999999 for v in values)
    assert llm.engine.pool.num_used == 0


def test_overlapped_steps_mask_with_the_tokens_still_in_flight(bundled_llm_float):
    with LLM(dtype="float32", max_num_seqs=4, overlap=True) as overlapped:
        for constraint in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-z]+ [0-9]{1,4}")):
            assert run(overlapped, constraint) == run(bundled_llm_float, constraint)


def test_a_bad_constraint_is_refused_before_anything_runs(bundled_llm_float):
    for constraint, words in ((StructuredOutputsParams(json={"type": "objekt"}), "invalid JSON schema"),
                              (StructuredOutputsParams(regex="(ab"), "invalid regex"),
                              (StructuredOutputsParams(grammar="root ::= nothing"), "invalid grammar")):
        with pytest.raises(ValueError, match=words):
            bundled_llm_float.generate(["a", "b"], SamplingParams(structured_outputs=constraint))
    assert not bundled_llm_float.engine.has_unfinished()
