"""Several samples of one prompt (`n`, `best_of`): one engine request per sample, sharing the prompt's pages.

    SamplingParams(n=3)  --sample_params-->  3 x SamplingParams(n=1), seeds seed, seed+1, seed+2
                                             sample 0 leads: it prefills the prompt
                                             samples 1, 2 wait (HeldRequests) until the leader's prompt KV is
                                             committed, then attach its full pages from the prefix cache and
                                             compute only the prompt's last, partly filled page
    best_of=5, n=2: 5 samples drawn, the 2 with the highest cumulative logprob kept (pick_best)

The offline API (LLM.generate) merges a prompt's samples into one RequestOutput (merge_samples); the server
streams each sample as a choice with its own index.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dflash2.request import RequestOutput
from dflash2.sampling_params import SEED_RANGE, SamplingParams


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each sample a request draws: `params` itself for one, else num_samples copies with
    n=1 and consecutive seeds (so seeded samples differ from each other and repeat from run to run). When
    best_of picks among them, each computes the logprob of its tokens (the pick reads the cumulative one)."""
    count = params.num_samples
    if count == 1:
        return [params]
    picking = count > params.n
    return [dataclasses.replace(params, n=1, best_of=None, seed=_seed(params.seed, index),
                                logprobs=0 if picking and params.logprobs is None else params.logprobs)
            for index in range(count)]


def _seed(seed: int | None, index: int) -> int | None:
    """seed + index, wrapped into the seed's range."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return (seed + index - low) % (high - low + 1) + low


def pick_best(outputs: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """The n outputs with the highest cumulative logprob, best first (ties: the earlier sample)."""
    ranked = sorted(range(len(outputs)), key=lambda i: -(outputs[i].outputs[0].cumulative_logprob or 0.0))
    return [outputs[i] for i in ranked[:n]]


def merge_samples(request_id: str, outputs: Sequence[RequestOutput], params: SamplingParams) -> RequestOutput:
    """One prompt's finished samples as one RequestOutput with `params.n` completions (indices 0..n-1); when
    best_of picked them and the caller asked for no logprobs, their logprobs are dropped."""
    kept = pick_best(outputs, params.n) if params.num_samples > params.n else list(outputs)
    completions = []
    for index, output in enumerate(kept):
        completion = dataclasses.replace(output.outputs[0], index=index)
        if params.logprobs is None:
            completion.logprobs = None
        completions.append(completion)
    first = outputs[0]
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, first.prompt_logprobs, completions,
                         True, first.num_cached_tokens)
