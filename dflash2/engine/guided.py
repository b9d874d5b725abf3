"""Structured output at run time: a grammar matcher per request and, each step, the token masks of its rows.

    Engine.add_request ──► GrammarCompilers.state_for() ──► request.guided = GuidedState (xgrammar's matcher)
    ModelRunner._sample, only when some sampled row is guided (the others never reach this module):

        device:  ... step N samples | step N+1 forward ....................| N+1 masked sampling
        host:    launch N+1 forward | catch up: each guided matcher accepts the tokens sampled since its last
                                    |   mask (step N's read from its pinned copy once that copy is done: it
                                    |   ends as N+1's forward starts)
                                    | fill its row of the bitmask (pinned) | copy it to the device (async) |
                                    | queue the sampling, which applies the mask (apply_token_mask)

So on the GPU the host builds step N+1's masks while N+1's forward runs, and the device waits for the host only
if building them takes longer than the forward; the host waits for nothing but step N's token copy. Requests
without structured outputs cost one flag check per row. On the CPU (steps not overlapped) every token is known
and the mask is built in place.

A mask is one bit per vocabulary entry (xgrammar's layout: int32 words, bit j of word w allows token 32 w + j).
Once the grammar is complete it allows only the model's EOS ids, so the request ends with finish_reason "stop".
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash2.engine.transfer import to_device
from dflash2.structured_outputs import JSON_SEPARATORS, GrammarSource, StructuredOutputsParams, parse_grammar

logger = logging.getLogger("dflash2")

COMPILER_THREADS = 2


class GuidedState:
    """One request's matcher, and how many of its output tokens it has accepted."""

    __slots__ = ("matcher", "token_ids", "first_output", "num_accepted", "broken")

    def __init__(self, matcher: Any, token_ids: list[int], first_output: int) -> None:
        self.matcher = matcher
        self.token_ids = token_ids  # the request's own list: prompt, then outputs (placeholders while in flight)
        self.first_output = first_output
        self.num_accepted = 0
        self.broken = False  # a token the grammar refused (cannot happen under its masks): no mask from then on

    def catch_up(self, known: Callable[[int], int]) -> None:
        """Accept the outputs not yet accepted; `known` turns a placeholder into its sampled token."""
        outputs = len(self.token_ids) - self.first_output
        while self.num_accepted < outputs and not self.broken:
            token_id = known(self.token_ids[self.first_output + self.num_accepted])
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
                logger.warning("the grammar refused token %d; the rest of this output is not constrained", token_id)
                self.broken = True
            self.num_accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row]: all once broken, or once the grammar took its EOS (an
        overlapped step samples one more token for a request that just stopped; the engine drops it)."""
        if self.broken or self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompilers:
    """One xgrammar GrammarCompiler per model (its vocabulary and EOS ids), built when its first structured request
    comes; compiled grammars are cached by the compiler."""

    def __init__(self) -> None:
        self._compilers: dict[str, Any] = {}

    def state_for(self, model: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                  params: StructuredOutputsParams, token_ids: list[int]) -> GuidedState:
        """A fresh matcher of this request's grammar; ValueError naming what is wrong with it."""
        import xgrammar as xgr

        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        source = params.grammar_source()
        parse_grammar(source)  # the clear message for a bad one
        compiled = self._compile(self._compiler(model, tokenizer, vocab_size, eos_token_ids), source)
        return GuidedState(xgr.GrammarMatcher(compiled), token_ids, len(token_ids))

    def forget(self, model: str) -> None:
        self._compilers.pop(model, None)

    def _compiler(self, model: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
        compiler = self._compilers.get(model)
        if compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(eos_token_ids))
            compiler = self._compilers[model] = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS)
        return compiler

    @staticmethod
    def _compile(compiler: Any, source: GrammarSource) -> Any:
        try:
            if source.kind == "json_schema":
                return compiler.compile_json_schema(source.text, any_whitespace=False, separators=JSON_SEPARATORS,
                                                    strict_mode=source.strict)
            if source.kind == "regex":
                return compiler.compile_regex(source.text)
            if source.kind == "lark":
                return compiler.compile_lark(source.text)
            return compiler.compile_grammar(source.text)
        except RuntimeError as e:
            raise ValueError(f"the grammar does not compile: {str(e).strip()[:500]}") from None


@dataclass
class TokenMask:
    """The allowed tokens of some rows of a step's logits: bitmask[i] is for logits row rows[i]."""

    bitmask: torch.Tensor  # int32 [len(rows), words], on the logits' device
    rows: list[int]


class TokenMasks:
    """A runner's mask buffers on the host: on CUDA two pinned halves, used in turn (one is filled while the other's
    copy to the device may still be in flight; an event says when a half is free again). The device copy is a fresh
    tensor a step (a few rows: the caching allocator hands it out in the sampling's stream order), so no device
    memory is held for masks between steps."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = -(-vocab_size // 32)
        self.device = device
        self.host = torch.empty((2, max_rows, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.copied: list[torch.cuda.Event | None] = [None, None]  # per host half: the event after its latest copy
        self.half = 0

    def prepare(self, rows: Sequence[Any], known: Callable[[int], int]) -> TokenMask:
        """The masks of the rows whose `guided` is set (SamplingRow), their matchers caught up first."""
        guided = [i for i, row in enumerate(rows) if row.guided is not None]
        half = self.half
        self.half = 1 - half
        if self.copied[half] is not None:
            self.copied[half].synchronize()  # its copy two steps ago is long done
        host = self.host[half, :len(guided)]
        for index, row_index in enumerate(guided):
            state = rows[row_index].guided
            state.catch_up(known)
            state.fill(host, index)
        if self.device.type != "cuda":
            return TokenMask(host, guided)
        bitmask = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[half] = event
        return TokenMask(bitmask, guided)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """A copy of `logits` whose masked rows are -inf outside their allowed tokens. A row the mask would leave
    without any finite logit (e.g. min_tokens banning the EOS the finished grammar allows) keeps its logits."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.bitmask.unsqueeze(-1) >> bits) & 1).bool().view(len(mask.rows), -1)[:, :vocab]
    index = to_device(mask.rows, torch.long, logits.device)
    result = logits.clone()
    rows = result.index_select(0, index)
    masked = rows.masked_fill(~allowed, float("-inf"))
    left = (masked > float("-inf")).any(dim=-1, keepdim=True)
    result.index_copy_(0, index, torch.where(left, masked, rows))
    return result
