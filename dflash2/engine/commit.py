"""The commit side of a step: its sampled tokens into their requests, and the RequestOutputs they make.

    StepResult ─► Committer.commit(): prompt logprobs, then for each sampled token: put it in place (replacing its
                  placeholder), record its logprobs, detokenize, check the stop conditions ─► an output on the first
                  token, then every stream_interval tokens, and at the finish (final_only: at the finish only);
                  a finished request's filled pages stay cached, the rest are freed, and the request is forgotten.

The Committer shares the engine's `requests` dict (it deletes finished requests from it) and owns each request's
detokenizer. A request whose own part of a step failed ends alone (fail()); take_failures() hands those over.
"""
from __future__ import annotations

from typing import Any

from dflash2.engine.detokenizer import IncrementalDetokenizer
from dflash2.engine.plan import StepPlan
from dflash2.engine.runner import StepResult
from dflash2.engine.served_model import ServedModel
from dflash2.request import CompletionOutput, Request, RequestOutput, RequestStatus, TokenView


class Committer:
    def __init__(self, requests: dict[str, Request], stream_interval: int) -> None:
        self.requests = requests  # the engine's own dict, not a copy
        self.stream_interval = stream_interval
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._failures: list[tuple[str, str]] = []  # requests ended by a failure of their own (take_failures)

    def commit(self, served: ServedModel, plan: StepPlan, result: StepResult,
               placeholders: list[int] | None) -> list[RequestOutput]:
        """Commit one step of `served` (`placeholders`: the ones its tokens replace, overlapped; None: appended)."""
        outputs = []
        for request_id, (start, entries) in result.prompt_logprobs.items():
            if request_id in self.requests:
                _record_prompt_logprobs(served.tokenizer, self.requests[request_id], start, entries)
        for index, (request_id, token_id) in enumerate(result.sampled.items()):
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue  # finished or aborted while this step was in flight
            if request_id in result.failed:
                self.fail(served, request, result.failed[request_id])
                continue
            num_outputs = _place_token(request, token_id, placeholders[index] if placeholders else None)
            _record_logprobs(served.tokenizer, request, token_id, result.logprobs.get(request_id))
            status = self._check_stop(served, request, token_id, num_outputs)
            if status is None:
                streamed = request.num_streamed_tokens
                if not request.sampling_params.final_only and (
                        streamed == 0 or num_outputs - streamed >= self.stream_interval):
                    outputs.append(self._output(request, _unstreamed(request, token_id, num_outputs), num_outputs))
                continue
            served.kv.commit(request)  # the pages this step filled stay reusable (on_step_done skips it now)
            served.scheduler.finish(request, status)
            outputs.append(self._output(request, _unstreamed(request, token_id, num_outputs), num_outputs))
            del self.requests[request_id]
            del self.detokenizers[request_id]
        served.scheduler.on_step_done(plan)
        return outputs

    def fail(self, served: ServedModel, request: Request, reason: str) -> None:
        """End one request whose step part raised (its neighbours go on); take_failures() reports it."""
        served.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        del self.requests[request.request_id]
        del self.detokenizers[request.request_id]
        self._failures.append((request.request_id, reason))

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of the requests ended by a failure since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _check_stop(self, served: ServedModel, request: Request, token_id: int,
                    num_outputs: int) -> RequestStatus | None:
        params = request.sampling_params
        detok = self.detokenizers[request.request_id]
        past_min = num_outputs >= params.min_tokens
        stop_string = detok.add_token(token_id, check_stop=past_min)
        if past_min:
            if token_id in served.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_prompt_tokens + num_outputs >= served.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, new_token_ids: list[int], num_outputs: int) -> RequestOutput:
        finished = request.status.finished
        detok = self.detokenizers[request.request_id]
        first = request.num_prompt_tokens
        completion = CompletionOutput(
            index=0, text=detok.text,
            token_ids=list(request.token_ids[first:first + num_outputs]) if finished
            else TokenView(request.token_ids, first, first + num_outputs),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs, finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, request.prompt_logprobs,
                             [completion], finished, request.num_cached_tokens,
                             delta_text=detok.take_delta(finished), delta_token_ids=new_token_ids)


def _unstreamed(request: Request, token_id: int, num_outputs: int) -> list[int]:
    """The output tokens up to num_outputs not yet in an output (the latest one is token_id); marks them
    streamed."""
    streamed, request.num_streamed_tokens = request.num_streamed_tokens, num_outputs
    if streamed == num_outputs - 1:
        return [token_id]
    first = request.num_prompt_tokens
    return request.token_ids[first + streamed:first + num_outputs]


def _place_token(request: Request, token_id: int, placeholder: int | None) -> int:
    """Put the sampled token in place (replacing its placeholder); returns the output count up to it."""
    if placeholder is None:
        request.token_ids.append(token_id)
        return request.num_output_tokens
    index = len(request.token_ids) - 1
    while request.token_ids[index] != placeholder:
        index -= 1
    request.token_ids[index] = token_id
    return index + 1 - request.num_prompt_tokens


def _record_logprobs(tokenizer: Any, request: Request, token_id: int, entries: dict | None) -> None:
    if request.logprobs is None or entries is None:
        return
    _decode_entries(tokenizer, entries)
    request.logprobs.append(entries)
    request.cumulative_logprob += entries[token_id].logprob


def _record_prompt_logprobs(tokenizer: Any, request: Request, start: int, entries: list[dict]) -> None:
    assert request.prompt_logprobs is not None
    for offset, entry in enumerate(entries):
        if start + offset == len(request.prompt_logprobs):  # skip positions recorded before a preemption
            _decode_entries(tokenizer, entry)
            request.prompt_logprobs.append(entry)


def _decode_entries(tokenizer: Any, entries: dict) -> None:
    """Each logprob entry's token text (the model's tokenizer; none: left unset)."""
    if tokenizer is not None:
        for token_id, entry in entries.items():
            entry.decoded_token = tokenizer.convert_ids_to_tokens(token_id)
