"""A request body's bytes -> JSON, refusing what would fail later or take the server down (each a 400):

    not JSON, or not UTF-8            json.loads' own errors
    NaN / Infinity                    not JSON numbers (Python's json takes them)
    an integer over 4,300 digits      Python's int() limit: a ValueError from json.loads
    nesting deeper than 64            100,000 levels overflowed json.loads' recursion; no body needs 64
    a lone UTF-16 surrogate           "\\ud800" decodes to a str no tokenizer or UTF-8 writer takes

Each was a 500 that also closed the client's keep-alive connection.
"""
from __future__ import annotations

import json
import re
from typing import Any

from dflash2.server.protocol import BadRequest

MAX_JSON_DEPTH = 64  # a chat body nests about 6 deep
_SURROGATE = re.compile("[\ud800-\udfff]")  # what JSON's "\ud800" decodes to when no pair follows


class _NotJson(ValueError):
    pass


def decode_json(raw: bytes) -> Any:
    """The body as JSON; BadRequest for what is not JSON, JSON's NaN / Infinity, integers over Python's 4,300
    digits, nesting over MAX_JSON_DEPTH and strings with a lone UTF-16 surrogate (text no tokenizer or UTF-8
    writer takes)."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except _NotJson as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # int("9" * 5000): Python's limit on integer digits
        raise BadRequest("the request body is not valid JSON: a number has too many digits") from None
    _check_values(data)
    return data


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _check_values(data: Any) -> None:
    """Walk the decoded body (no recursion): its depth, and every string (keys too) for lone surrogates."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param=field)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field if depth > 1 else None)
                if isinstance(item, (str, list, dict)):
                    stack.append((item, depth + 1, key if depth == 1 else field))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value if isinstance(item, (str, list, dict)))


def _check_text(text: str, field: str | None) -> None:
    match = _SURROGATE.search(text)
    if match is not None:
        raise BadRequest(f"a string in the request body holds a lone UTF-16 surrogate (\\u{ord(match.group()):04x}), "
                         "which is not text", param=field)
