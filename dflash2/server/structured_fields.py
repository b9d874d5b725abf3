"""The request fields that ask for structured output, as OpenAI and vLLM spell them, -> StructuredOutputsParams.

    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": {...}}}
                      ({"type": "text"}: nothing)
    guided_json       a schema (object or its text)      guided_regex    a regex
    guided_choice     a list of strings                  guided_grammar  EBNF or Lark
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM's current field)

At most one may be given; each is parsed here (xgrammar, without the tokenizer), so a bad schema, regex or grammar
is a 400 naming the field and what is wrong, before the request reaches the engine.
"""
from __future__ import annotations

from typing import Any

from dflash2.server.bad_request import BadRequest
from dflash2.structured_outputs import StructuredOutputsParams

BACKENDS = (None, "auto", "xgrammar")
# vLLM's structured_outputs options that ask for nothing here (their defaults)
_HARMLESS_OPTIONS = {"disable_fallback": False, "disable_any_whitespace": False,
                     "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The body's structured output (None: none asked for); BadRequest naming the field for a bad value."""
    if body.guided_decoding_backend not in BACKENDS:
        raise BadRequest(f"'guided_decoding_backend': only xgrammar is built in, got {body.guided_decoding_backend!r}",
                         param="guided_decoding_backend")
    given = [(field, params) for field, params in _requested(body) if params is not None]
    if len(given) > 1:
        raise BadRequest(f"give one structured output at a time, got {' and '.join(f for f, _ in given)}",
                         param=given[1][0])
    if not given:
        return None
    field, params = given[0]
    try:
        params.check()
    except ValueError as e:
        raise BadRequest(f"'{field}': {e}", param=field) from None
    return params


def _requested(body: Any) -> list[tuple[str, StructuredOutputsParams | None]]:
    return [("response_format", _from_response_format(body.response_format)),
            ("guided_json", None if body.guided_json is None else StructuredOutputsParams(json=body.guided_json)),
            ("guided_regex", None if body.guided_regex is None else StructuredOutputsParams(regex=body.guided_regex)),
            ("guided_choice", None if body.guided_choice is None else
             StructuredOutputsParams(choice=_choices(body.guided_choice, "guided_choice"))),
            ("guided_grammar", None if body.guided_grammar is None else
             StructuredOutputsParams(grammar=body.guided_grammar)),
            ("structured_outputs", _from_vllm(body.structured_outputs))]


def _from_response_format(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            raise BadRequest("'response_format': json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                             "{...}}}", param="response_format")
        return StructuredOutputsParams(json=schema)
    raise BadRequest(f"'response_format': type must be text, json_object or json_schema, got {kind!r}",
                     param="response_format")


def _from_vllm(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    fields = dict(value)
    for option, default in _HARMLESS_OPTIONS.items():
        if fields.pop(option, default) not in (default, None):
            raise BadRequest(f"'structured_outputs.{option}' is not supported", param="structured_outputs")
    unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise BadRequest(f"'structured_outputs' has no field {unknown[0]!r}", param="structured_outputs")
    if "choice" in fields and fields["choice"] is not None:
        fields["choice"] = _choices(fields["choice"], "structured_outputs")
    if not isinstance(fields.get("json_object", False), bool):
        raise BadRequest("'structured_outputs.json_object' must be a boolean", param="structured_outputs")
    params = StructuredOutputsParams(**fields)
    try:
        params.kind  # noqa: B018 - exactly one
    except ValueError as e:
        raise BadRequest(f"'structured_outputs': {e}", param="structured_outputs") from None
    return params


def _choices(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise BadRequest(f"'{field}' must be a non-empty list of non-empty strings", param=field)
    return value
