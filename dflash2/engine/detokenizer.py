"""Incremental detokenization and stop-string matching for one request.

Text is decoded token by token with the tokenizers library's DecodeStream, which holds back bytes of a
character split across tokens (Chinese, emoji) until the character is complete. With stop strings, the
last (longest stop - 1) characters are held back from streaming until they cannot start a stop string.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from dflash2.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 8  # prompt tokens fed first so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
                                     skip_special_tokens=params.skip_special_tokens)
                        if self._backend is not None else None)
        self._stop_strings = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop_strings), default=1) - 1
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; returns the stop string it completed (text is cut there), else None."""
        if self._stream is None:
            return None
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        if not check_stop or not self._stop_strings:
            return None
        return self._cut_at_stop(search_from)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, keeping back what could still become a stop string."""
        end = len(self.text) if finished or not self._stop_strings else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _cut_at_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        self._emitted = min(self._emitted, len(self.text))
        return stop
