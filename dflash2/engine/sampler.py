"""Sampler: one step's logits batch -> one token per request, plus optional logprobs (vLLM semantics).

Per row, in this order:

    raw logits --log_softmax--> logprobs (reported; nothing below changes them)
        |
    repetition penalty (prompt + output tokens), frequency / presence penalties (output tokens)
        |
    min_tokens: mask EOS ids and stop_token_ids while the output is still too short
        |
    logit_bias: each listed token's bias added
        |
    structured output: tokens the row's grammar does not allow next set to -inf (engine/guided.py)
        |
    greedy row (temperature < 1e-5) -> argmax (ties -> lowest id)
    random row -> / temperature -> top_k -> top_p -> min_p -> exponential race

The exponential race (argmax of probs / q, q ~ Exp(1)) draws q for each row from that row's own generator
when the request has a seed, so a seeded request gets the same tokens whatever else shares its batch.
All math stays on logits.device; only the final small results are copied to the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dflash2.engine.guided import TokenMask, apply_token_mask
from dflash2.engine.transfer import host_to_device, to_device
from dflash2.sampling_params import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely under the raw model distribution
    decoded_token: str | None = None  # filled in later by the engine


@dataclass
class SamplingRow:
    """One request's row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (before this step)
    generator: torch.Generator | None  # per-request generator when params.seed is set; else None
    eos_token_ids: Sequence[int]  # the model's EOS ids (min_tokens masks these and stop_token_ids)
    guided: Any = None  # the request's GuidedState (engine/guided.py) when its output must match a grammar


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, Logprob] | None]  # per row: None if params.logprobs is None, else top-k + sampled


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed`, for one request's random draws."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks the next token of every row; stateless apart from the generator for unseeded rows."""

    def __init__(self, default_generator: torch.Generator | None = None):
        # None means torch's default generator of logits.device.
        self.default_generator = default_generator

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        """Sample one token per row of `logits` ([num_rows, vocab]); `logits` itself is not modified."""
        token_ids_dev = self.sample_device(logits, rows)
        logprobs = sampled_logprobs(logits, token_ids_dev, rows)
        return SampleOutput(token_ids=token_ids_dev.tolist(), logprobs=logprobs)

    def sample_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                      greedy: torch.Tensor | None = None, token_mask: TokenMask | None = None) -> torch.Tensor:
        """The sampled token ids as a tensor on logits.device, without waiting for the device. `greedy`: the
        argmax of every row of `logits`, if already computed (a step graph's): returned as it is when every
        row is greedy and no penalty, min_tokens, bias or mask changes the logits. `token_mask`: the tokens
        allowed to the rows with structured output."""
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        edits = any(row.params.edits_logits for row in rows)  # one pass: penalties and biases skipped without
        if logits.dtype != torch.float32 and (random_rows or edits):
            logits = logits.float()  # exact; temperature, top-p, penalties and biases then compute in float32
        processed = apply_min_tokens(apply_penalties(logits, rows) if edits else logits, rows)
        if edits:
            processed = apply_logit_bias(processed, rows)
        if token_mask is not None:
            processed = apply_token_mask(processed, token_mask)
        if not random_rows:
            return greedy if greedy is not None and processed is logits else greedy_argmax(processed)
        return self._sample_mixed(processed, rows, random_rows)

    def _sample_mixed(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                      random_rows: list[int]) -> torch.Tensor:
        """Argmax for greedy rows, the exponential race for the rows listed in `random_rows`."""
        if len(random_rows) == len(rows):
            return self._sample_random(logits, rows)
        token_ids = logits.argmax(dim=-1)
        index = to_device(random_rows, torch.long, logits.device)
        token_ids[index] = self._sample_random(logits[index], [rows[i] for i in random_rows])
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p, then argmax(probs / q) with q ~ Exp(1)."""
        params = [row.params for row in rows]
        temperatures = _column([p.temperature for p in params], logits)
        logits = apply_top_k_top_p(logits / temperatures, [p.top_k for p in params], [p.top_p for p in params])
        probs = apply_min_p(logits.softmax(dim=-1), [p.min_p for p in params])
        noise = self._exponential_noise(rows, probs)
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, rows: Sequence[SamplingRow], like: torch.Tensor) -> torch.Tensor:
        """Exp(1) draws shaped like `like`; a seeded row draws its whole row from its own generator."""
        noise = torch.empty_like(like)
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if not seeded:
            noise.exponential_(generator=self.default_generator)
        else:
            unseeded = [i for i, row in enumerate(rows) if row.generator is None]
            if unseeded:
                index = to_device(unseeded, torch.long, like.device)
                draws = torch.empty((len(unseeded), like.shape[1]), dtype=like.dtype, device=like.device)
                noise[index] = draws.exponential_(generator=self.default_generator)
            for i in seeded:
                noise[i].exponential_(generator=rows[i].generator)
        # q == 0 would turn a dropped token's 0 / 0 into NaN; a tiny q keeps kept tokens winning instead.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def greedy_argmax(logits: torch.Tensor, future: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """argmax over the last dim (first index among equal maxima, like torch.argmax). future = (slots, base), a
    step graph's: row r's token is also stored into slots[base + r] for r < len(slots) / 2 (base: int64 [1],
    the runner's future-token half), which the runner then does not copy.

    On CUDA a single-row argmax over a large vocabulary runs as one thread block; reducing chunks first and
    then the chunk winners spreads the work over the GPU (about 28 us down to a few for 128k entries).
    """
    rows, vocab = logits.shape
    if logits.is_cuda and rows <= 64 and logits.stride(1) == 1:
        from dflash2.kernels.triton import step_edges

        if vocab <= step_edges.ARGMAX_MAX_CHUNKS * step_edges.ARGMAX_BLOCK:
            return step_edges.greedy_argmax(logits, future)  # one launch
    tokens = _argmax(logits)
    if future is not None:
        slots, base = future
        kept = min(rows, slots.numel() // 2)
        slots.index_copy_(0, base + torch.arange(kept, device=slots.device), tokens[:kept])
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim in torch ops: on CUDA the chunks' maxima, then the best chunk."""
    rows, vocab = logits.shape
    chunk = 1024
    while chunk > 1 and vocab % chunk:
        chunk //= 2
    if not logits.is_cuda or rows > 64 or chunk < 64:
        return logits.argmax(dim=-1)
    values, index_in_chunk = logits.view(rows, vocab // chunk, chunk).max(dim=-1)
    best_chunk = values.argmax(dim=-1, keepdim=True)
    return (best_chunk.squeeze(1) * chunk + index_in_chunk.gather(1, best_chunk).squeeze(1))


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties.

    Returns `logits` itself when no row has a penalty, else a new tensor; the input is never modified.
    """
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalty]
    if not penalized:
        return logits
    sub_rows = [rows[i] for i in penalized]
    index = to_device(penalized, torch.long, logits.device)
    sub = logits[index]
    vocab = logits.shape[1]
    output_counts = _token_counts([row.output_token_ids for row in sub_rows], vocab, logits.device)
    output_seen = output_counts > 0
    repetition = _column([row.params.repetition_penalty for row in sub_rows], sub)
    if any(row.params.repetition_penalty != 1.0 for row in sub_rows):
        prompt_seen = _token_counts([row.prompt_token_ids for row in sub_rows], vocab, logits.device) > 0
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(prompt_seen | output_seen, scaled, sub)
    frequency = _column([row.params.frequency_penalty for row in sub_rows], sub)
    presence = _column([row.params.presence_penalty for row in sub_rows], sub)
    sub = sub - frequency * output_counts - presence * output_seen
    result = logits.clone()
    result[index] = sub
    return result


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set EOS ids and stop_token_ids to -inf in rows whose output is shorter than min_tokens.

    Returns `logits` itself when no row is masked, else a new tensor.
    """
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        banned = set(row.eos_token_ids) | set(row.params.stop_token_ids or [])
        row_index.extend([i] * len(banned))
        token_index.extend(banned)
    if not row_index:
        return logits
    result = logits.clone()
    rows_dev = to_device(row_index, torch.long, logits.device)
    tokens_dev = to_device(token_index, torch.long, logits.device)
    result[rows_dev, tokens_dev] = float("-inf")
    return result


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's logit_bias to its tokens' logits (-100 all but bans a token, as in OpenAI's API).

    Returns `logits` itself when no row has a bias, else a new tensor.
    """
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            row_index.extend([i] * len(bias))
            token_index.extend(bias)
            values.extend(bias.values())
    if not row_index:
        return logits
    result = logits.clone()
    rows_dev = to_device(row_index, torch.long, logits.device)
    tokens_dev = to_device(token_index, torch.long, logits.device)
    result.index_put_((rows_dev, tokens_dev), to_device(values, logits.dtype, logits.device), accumulate=True)
    return result


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Set to -inf all but each row's top_k tokens (0: all), then all outside its nucleus.

    The nucleus is the smallest set of most likely tokens whose probability (after top_k) sums to at least
    top_p; it always holds the most likely token. Ties are broken toward the lower id, as argmax does.
    """
    use_top_k = any(k > 0 for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if not use_top_k and not use_top_p:
        return logits
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        positions = torch.arange(vocab, device=logits.device)
        limits = to_device([k if k > 0 else vocab for k in top_k], torch.long, logits.device)
        drop |= positions >= limits.unsqueeze(1)
    if use_top_p:
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= _column(top_p, sorted_probs)
        drop[:, 0] = False
    drop_by_id = torch.empty_like(drop).scatter_(1, sorted_ids, drop)
    return logits.masked_fill(drop_by_id, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Zero the probability of tokens below min_p * (the row's largest probability); not renormalized."""
    if not any(p > 0.0 for p in min_p):
        return probs
    threshold = _column(min_p, probs) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num_top: int) -> list[dict[int, Logprob]]:
    """For each i, the top-`num_top` logprobs of logits[i] plus the entry of next_token_ids[i]."""
    token_ids = to_device(list(next_token_ids), torch.long, logits.device)
    return _logprob_dicts(logits, token_ids, [num_top] * len(next_token_ids))


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                      rows: Sequence[SamplingRow]) -> list[dict[int, Logprob] | None]:
    """Raw-logit logprobs for the rows that asked for them; None for the others."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[dict[int, Logprob] | None] = [None] * len(rows)
    if not wanted:
        return result
    num_tops = [rows[i].params.logprobs for i in wanted]
    if len(wanted) < len(rows):
        index = to_device(wanted, torch.long, logits.device)
        logits, token_ids = logits[index], token_ids[index]
    for i, entries in zip(wanted, _logprob_dicts(logits, token_ids, num_tops)):
        result[i] = entries
    return result


def _logprob_dicts(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_tops: Sequence[int]) -> list[dict[int, Logprob]]:
    """Per row: {token_ids[i]: ..., then the row's top num_tops[i] tokens}, ranked in the raw distribution.

    Rank = 1 + number of tokens with a strictly larger logprob. Every token larger than a top-k token is
    itself in the top k, so a top-k rank is the position of the first equal value in the row's sorted top k
    (a binary search: memory linear in k, where comparing every pair took k x k per row).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    token_ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=-1) + 1
    max_top = min(max(num_tops, default=0), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(max_top, dim=-1)  # sorted, largest first
    ascending = -top_logprobs
    top_ranks = torch.searchsorted(ascending, ascending, side="left") + 1
    rows = zip(token_ids.tolist(), token_logprobs.tolist(), token_ranks.tolist(),
               top_ids.tolist(), top_logprobs.tolist(), top_ranks.tolist(), num_tops)
    result = []
    for token_id, token_logprob, token_rank, ids, values, ranks, num_top in rows:
        entries = {token_id: Logprob(token_logprob, token_rank)}
        for top_id, value, rank in zip(ids[:num_top], values[:num_top], ranks[:num_top]):
            entries.setdefault(top_id, Logprob(value, rank))
        result.append(entries)
    return result


def _token_counts(sequences: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(sequences), vocab] float counts of each token id in each sequence."""
    width = max((len(seq) for seq in sequences), default=0)
    padded = [list(seq) + [vocab] * (width - len(seq)) for seq in sequences]  # id `vocab` = padding
    ids = host_to_device(torch.tensor(padded, dtype=torch.long).reshape(len(sequences), width), device)
    counts = torch.zeros((len(sequences), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row scalars as a [num_rows, 1] tensor matching `like`'s dtype and device."""
    return to_device(list(values), like.dtype, like.device).unsqueeze(1)
