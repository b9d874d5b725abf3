"""StructuredOutputsParams: the output must match a JSON schema, any JSON object, a regex, one of some strings or
a grammar (vLLM's names); `grammar_source()` turns each into what the grammar engine (xgrammar) compiles.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

Exactly one kind is given. `check()` parses it without a tokenizer (milliseconds), so a bad schema, regex or
grammar is refused when the request comes, with xgrammar's own words; engine/guided.py compiles it against the
model's vocabulary.

JSON comes out compact (no free whitespace between tokens): a small model given free whitespace may fill the
output with newlines and never close the object.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

JSON_SEPARATORS = (", ", ": ")
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSource:
    """What to compile: kind is "json_schema" (text: the schema; strict: no properties beyond the schema's),
    "regex" or "ebnf" / "lark" (text: the grammar)."""

    kind: str
    text: str
    strict: bool = True


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's, GBNF-like) or Lark

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))  # frozen and hashable

    @property
    def kind(self) -> str:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        return given[0]

    def grammar_source(self) -> GrammarSource:
        """What the grammar engine compiles (ValueError for a value of the wrong type)."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            if isinstance(schema, dict):
                return GrammarSource("json_schema", json.dumps(schema))
            if not isinstance(schema, str):
                raise ValueError(f"structured_outputs json must be a JSON schema object, got {type(schema).__name__}")
            return GrammarSource("json_schema", schema)
        if kind == "json_object":
            return GrammarSource("json_schema", '{"type": "object"}', strict=False)
        if kind == "regex":
            _check_text("regex", self.regex)
            return GrammarSource("regex", self.regex)
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
            return GrammarSource("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in self.choice))
        _check_text("grammar", self.grammar)
        return GrammarSource("lark" if _looks_like_lark(self.grammar) else "ebnf", self.grammar)

    def check(self) -> None:
        """ValueError saying what is wrong with the schema, regex or grammar (parsed, not compiled)."""
        source = self.grammar_source()
        parse_grammar(source)


def parse_grammar(source: GrammarSource) -> Any:
    """The xgrammar Grammar of `source`; ValueError with xgrammar's message (its file and line left out)."""
    import xgrammar as xgr

    try:
        if source.kind == "json_schema":
            json.loads(source.text)
            return xgr.Grammar.from_json_schema(source.text, any_whitespace=False, separators=JSON_SEPARATORS,
                                                strict_mode=source.strict)
        if source.kind == "regex":
            return xgr.Grammar.from_regex(source.text)
        if source.kind == "lark":
            return xgr.Grammar.from_lark(source.text)
        return xgr.Grammar.from_ebnf(source.text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, but any failure is the input's
        what = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "ebnf": "grammar"}[source.kind]
        raise ValueError(f"invalid {what}: {_engine_message(e)}") from None


def _engine_message(error: Exception) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    text = str(error).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs {name} must be a non-empty string")


def _looks_like_lark(grammar: str) -> bool:
    """Lark rules are `name: ...`; EBNF rules are `name ::= ...`."""
    return "::=" not in grammar and re.search(r"^\s*\??[a-z_][a-z_0-9]*\s*:", grammar, re.MULTILINE) is not None
