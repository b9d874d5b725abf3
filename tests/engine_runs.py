"""Shared by engine-level tests: drive an Engine step by step with urgent requests arriving mid-run."""
from __future__ import annotations

from dflash2 import SamplingParams
from dflash2.engine.engine import Engine


def run_with_urgent_arrivals(engine: Engine, low: list[list[int]], high: list[list[int]], params: SamplingParams,
                             steps_before: int) -> list[list[int]]:
    """Priority-0 requests for `steps_before` steps, then priority-1000 ones; runs to the end and returns each
    request's output tokens, low then high, in the order given."""
    finished = {}
    ids = [engine.add_request({"prompt_token_ids": p}, params, priority=0).request_id for p in low]
    for _ in range(steps_before):
        for output in engine.step():
            finished[output.request_id] = output
    ids += [engine.add_request({"prompt_token_ids": p}, params, priority=1000).request_id for p in high]
    while engine.has_unfinished():
        for output in engine.step():
            finished[output.request_id] = output
    return [finished[i].outputs[0].token_ids for i in ids]
