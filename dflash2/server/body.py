"""The strict base of every request body, and a decoded JSON body -> one of them (a 400 naming the first bad field).

Types are strict (a string is not a number), except that an integer field (Int) takes an integral float (2.0), as
OpenAI's API does; NaN and infinities are refused. A field a model does not declare passes, and the server log
names it once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from dflash2.server.bad_request import BadRequest

logger = logging.getLogger("dflash2.server")

_MAX_LOGGED_UNKNOWN = 256  # unknown field names logged (once each); past it, no more are logged


def _integral(value: Any) -> Any:
    """2.0 -> 2 (OpenAI's API takes it); 2.5 stays a float, which the strict int then refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    def check(self) -> None:
        """BadRequest naming the first field that asks for what this server lacks."""
        for name, (fine, why) in self.unsupported.items():
            if not fine(getattr(self, name)):
                raise BadRequest(f"'{name}': {why}", param=name)


# -- validating a decoded body ----------------------------------------------------------------------
def parse_body(model: type[Body], data: Any) -> Any:
    """Validate a decoded JSON body; BadRequest naming the first bad field."""
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(*_describe(e)) from None
    _log_unknown(model, data)
    body.check()
    if getattr(body, "stream_options", None) is not None:
        body.stream_options.check()
    return body


_logged_unknown: set[str] = set()


def _log_unknown(model: type[Body], data: dict[str, Any]) -> None:
    """Fields of neither API pass; the log names each once (at most _MAX_LOGGED_UNKNOWN names)."""
    for name in data:
        if name not in model.model_fields and name not in _logged_unknown \
                and len(_logged_unknown) < _MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(name)
            logger.warning("ignoring the request field %r, which this server does not know (logged once)", name[:100])


def _describe(error: ValidationError) -> tuple[str, str | None]:
    errors = error.errors()
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else None
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if first["type"] == "missing":
        return f"'{field}' is required", field
    if len(same_field) > 1:  # a union: every alternative failed
        value = first.get("input")
        return f"'{field}' has the wrong type ({type(value).__name__})", field
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"'{where}': {first['msg']}", field
