"""BadRequest: a client error, answered with an OpenAI-style error body (protocol.py and the modules it uses)."""
from __future__ import annotations


class BadRequest(ValueError):
    """A client error, answered as 400 (or status_code) with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status_code = status_code
