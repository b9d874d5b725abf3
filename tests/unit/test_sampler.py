"""Sampler: greedy, seeded reproducibility, top_k / top_p / min_p sets, penalties, min_tokens, logprobs."""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from dflash2.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    make_generator,
    prompt_logprobs,
)
from dflash2.sampling_params import SamplingParams

VOCAB = 32


def make_row(params: SamplingParams | None = None, *, prompt: Sequence[int] = (), output: Sequence[int] = (),
             eos: Sequence[int] = (), seeded: bool = True) -> SamplingRow:
    params = params or SamplingParams()
    generator = make_generator(params.seed) if seeded and params.seed is not None else None
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=generator, eos_token_ids=list(eos))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn((num_rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


def logits_from_probs(probs_by_id: dict[int, float], vocab: int) -> torch.Tensor:
    """One row whose softmax puts probs_by_id[i] on id i and (almost) nothing elsewhere."""
    row = torch.full((vocab,), -1e9)
    for token_id, prob in probs_by_id.items():
        row[token_id] = math.log(prob)
    return row


def sampled_ids(logits_row: torch.Tensor, params_kwargs: dict, num_draws: int = 400) -> set[int]:
    """Sample the same row num_draws times in one batch, each row with its own seed."""
    rows = [make_row(SamplingParams(seed=seed, **params_kwargs)) for seed in range(num_draws)]
    logits = logits_row.expand(num_draws, -1).contiguous()
    return set(Sampler().sample(logits, rows).token_ids)


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax_including_ties() -> None:
    logits = random_logits(6)
    logits[2, 4] = logits[2, 9] = logits[2].max() + 1.0  # tie: lowest id wins
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 4
    assert out.logprobs == [None] * 6


def test_sample_does_not_modify_logits() -> None:
    logits = random_logits(3)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, min_tokens=4, seed=3, logprobs=2)
    rows = [make_row(params, prompt=[1, 2], output=[3], eos=[0]) for _ in range(3)]
    Sampler().sample(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_one_equals_greedy(temperature: float) -> None:
    logits = random_logits(8, seed=1)
    logits[5, 7] = logits[5, 2] = logits[5].max() + 0.5  # tie: top_k=1 keeps the lowest id, like argmax
    rows = [make_row(SamplingParams(temperature=temperature, top_k=1, seed=i)) for i in range(8)]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = random_logits(6, seed=2)
    rows = [make_row(SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i)) for i in range(6)]
    out = Sampler().sample(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]
    assert all(0 <= t < VOCAB for t in out.token_ids)


# ---------------------------------------------------------------- seeded reproducibility


def run_steps(seed: int, layout: str, num_steps: int = 6) -> list[int]:
    """Sample num_steps tokens for the seeded request under test, with other rows around it."""
    target = make_row(SamplingParams(temperature=1.0, seed=seed))
    target_logits = random_logits(num_steps, vocab=1000, seed=100)
    sampler = Sampler(default_generator=torch.Generator().manual_seed(len(layout)))
    tokens = []
    for step in range(num_steps):
        others = {
            "alone": [],
            "front": [make_row(SamplingParams(seed=99)), make_row(SamplingParams(temperature=0.5))],
            "back": [make_row(SamplingParams(temperature=0.0)), make_row(SamplingParams(top_p=0.5))],
        }[layout]
        rows = [target, *others] if layout == "front" else [*others, target]
        logits = torch.cat([target_logits[step:step + 1], random_logits(len(others), 1000, seed=step + 7)])
        if layout != "front":
            logits = logits.roll(-1, dims=0)  # target row last
        tokens.append(sampler.sample(logits, rows).token_ids[rows.index(target)])
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    alone = run_steps(seed=1234, layout="alone")
    assert run_steps(seed=1234, layout="alone") == alone
    assert run_steps(seed=1234, layout="front") == alone
    assert run_steps(seed=1234, layout="back") == alone
    assert run_steps(seed=4321, layout="alone") != alone


# ---------------------------------------------------------------- top_k / top_p / min_p sets


def test_top_k_keeps_the_k_most_likely() -> None:
    row = logits_from_probs({3: 0.4, 0: 0.3, 5: 0.2, 1: 0.1}, vocab=8)
    assert sampled_ids(row, {"top_k": 2}) == {3, 0}
    assert sampled_ids(row, {"top_k": 3}) == {3, 0, 5}


@pytest.mark.parametrize("top_p, nucleus", [
    (1.0, {3, 0, 5, 1}),
    (0.95, {3, 0, 5, 1}),
    (0.85, {3, 0, 5}),
    (0.65, {3, 0}),
    (0.35, {3}),
    (0.01, {3}),
])
def test_top_p_keeps_exactly_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    row = logits_from_probs({3: 0.4, 0: 0.3, 5: 0.2, 1: 0.1}, vocab=8)
    assert sampled_ids(row, {"top_p": top_p}) == nucleus


def test_top_p_applies_after_top_k_and_temperature() -> None:
    row = logits_from_probs({3: 0.4, 0: 0.3, 5: 0.2, 1: 0.1}, vocab=8)
    # After top_k=3 the probabilities are 4/9, 3/9, 2/9: top_p=0.7 needs ids 3 and 0 (7/9), not 5.
    assert sampled_ids(row, {"top_k": 3, "top_p": 0.7}) == {3, 0}
    # Temperature 0.5 squares the probabilities: 16/30, 9/30, 4/30, 1/30; top_p=0.8 keeps 3 and 0 (25/30).
    assert sampled_ids(row, {"temperature": 0.5, "top_p": 0.8}) == {3, 0}


@pytest.mark.parametrize("min_p, kept", [
    (0.0, {2, 6, 4, 7}),
    (0.2, {2, 6, 4}),   # threshold 0.1
    (0.5, {2, 6}),      # threshold 0.25
    (0.9, {2}),         # threshold 0.45
])
def test_min_p_drops_tokens_below_threshold(min_p: float, kept: set[int]) -> None:
    row = logits_from_probs({2: 0.5, 6: 0.3, 4: 0.15, 7: 0.05}, vocab=8)
    assert sampled_ids(row, {"min_p": min_p}) == kept


# ---------------------------------------------------------------- penalties and min_tokens


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    penalized = make_row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                         prompt=[0, 1, 1], output=[3, 3, 4])
    plain = make_row(SamplingParams(), prompt=[0, 1], output=[3, 3, 4])
    before = logits.clone()
    result = apply_penalties(logits, [penalized, plain])
    # id 0: prompt, positive -> 2 / 2; id 1: prompt, negative -> -1 * 2; id 2, 5: untouched
    # id 3: output twice -> 3 / 2 - 0.5 * 2 - 0.25; id 4: output once -> -2 * 2 - 0.5 - 0.25
    expected = torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 0.0])
    assert torch.equal(result[0], expected)
    assert torch.equal(result[1], before[1])
    assert torch.equal(logits, before)


def test_each_penalty_alone() -> None:
    logits = torch.tensor([[1.0, 1.0, -1.0, 1.0]] * 3)
    rows = [
        make_row(SamplingParams(repetition_penalty=0.5), prompt=[0], output=[2]),
        make_row(SamplingParams(frequency_penalty=-1.0), prompt=[0], output=[2, 2, 3]),
        make_row(SamplingParams(presence_penalty=1.5), prompt=[0], output=[2, 2, 3]),
    ]
    result = apply_penalties(logits, rows)
    assert result[0].tolist() == [2.0, 1.0, -0.5, 1.0]
    assert result[1].tolist() == [1.0, 1.0, 1.0, 2.0]   # prompt tokens are not frequency-penalized
    assert result[2].tolist() == [1.0, 1.0, -2.5, -0.5]


def test_no_penalty_returns_logits_untouched() -> None:
    logits = random_logits(2)
    assert apply_penalties(logits, [make_row(output=[1, 2]), make_row()]) is logits


def test_repetition_penalty_steers_greedy() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]])
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[1])
    assert Sampler().sample(logits, [row]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros((3, 10))
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    short = make_row(params, output=[1, 2], eos=[5, 6])
    done = make_row(params, output=[1, 2, 3], eos=[5, 6])
    ignoring = make_row(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),
                        output=[], eos=[5])
    result = apply_min_tokens(logits, [short, done, ignoring])
    inf = float("-inf")
    assert result[0].tolist() == [0, 0, 0, 0, 0, inf, inf, inf, 0, 0]
    assert result[1].tolist() == [0.0] * 10
    assert result[2].tolist() == [0, 0, 0, 0, 0, inf, 0, inf, 0, 0]
    assert torch.equal(logits, torch.zeros((3, 10)))


def test_min_tokens_changes_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 2)
    params = SamplingParams(temperature=0.0, min_tokens=1)
    rows = [make_row(params, output=[], eos=[2]), make_row(params, output=[1], eos=[2])]
    assert Sampler().sample(logits, rows).token_ids == [3, 2]
    random_rows = [make_row(SamplingParams(seed=i, min_tokens=2, stop_token_ids=[3]), eos=[2]) for i in range(50)]
    tokens = Sampler().sample(logits[:1].expand(50, -1), random_rows).token_ids
    assert set(tokens) <= {0, 1} and set(tokens) == {0, 1}


# ---------------------------------------------------------------- logprobs


def check_logprob_entries(entries: dict, raw_row: torch.Tensor, num_top: int, must_contain: int) -> None:
    """Values are log_softmax(raw); rank = 1 + count strictly greater; keys = top num_top + must_contain."""
    expected = torch.log_softmax(raw_row, dim=-1)
    top_ids = set(expected.topk(num_top).indices.tolist()) if num_top else set()
    assert set(entries) == top_ids | {must_contain}
    for token_id, entry in entries.items():
        assert entry.logprob == pytest.approx(expected[token_id].item(), abs=1e-6)
        assert entry.rank == int((expected > expected[token_id]).sum()) + 1
        assert entry.decoded_token is None


def test_logprobs_come_from_raw_logits() -> None:
    logits = random_logits(4, seed=5)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=3)),
        make_row(SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.5, presence_penalty=1.0,
                                seed=1, logprobs=5), prompt=[0, 1, 2], output=[3, 4]),
        make_row(SamplingParams(temperature=1.0, seed=2)),
        make_row(SamplingParams(temperature=2.0, seed=3, logprobs=0)),
    ]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[2] is None
    for i, num_top in ((0, 3), (1, 5), (3, 0)):
        check_logprob_entries(out.logprobs[i], logits[i], num_top, out.token_ids[i])
    assert out.logprobs[0][out.token_ids[0]].rank == 1
    assert len(out.logprobs[3]) == 1


def test_logprob_ranks_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 2.0, 0.0]])
    row = make_row(SamplingParams(temperature=0.0, logprobs=6))
    entries = Sampler().sample(logits, [row]).logprobs[0]
    assert {token_id: entry.rank for token_id, entry in entries.items()} == {1: 1, 2: 1, 3: 3, 4: 3, 0: 5, 5: 6}


def test_sampled_token_outside_top_k_is_included() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    row = make_row(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[0, 1, 2], logprobs=2), eos=[3])
    out = Sampler().sample(logits, [row])
    assert out.token_ids == [4]
    check_logprob_entries(out.logprobs[0], logits[0], 2, 4)
    assert out.logprobs[0][4].rank == 5


def test_prompt_logprobs_values() -> None:
    logits = random_logits(5, seed=9)
    next_ids = [3, 17, 0, 31, 8]
    for num_top in (0, 2, 4):
        result = prompt_logprobs(logits, next_ids, num_top)
        assert len(result) == 5
        for i, entries in enumerate(result):
            check_logprob_entries(entries, logits[i], num_top, next_ids[i])


def test_top_logprobs_over_the_whole_vocabulary_take_memory_linear_in_it() -> None:
    """Ranks of the top k used to compare every pair (a k x k table a row: 22 GB at a real vocabulary)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = 4096
    logits = random_logits(2, vocab=vocab, seed=3)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = prompt_logprobs(logits, [0, 1], vocab)
    largest_allocation = max(event.cpu_memory_usage for event in prof.events())
    assert largest_allocation <= 16 * logits.numel() * 4, largest_allocation
    for i, entries in enumerate(result):
        check_logprob_entries(entries, logits[i], vocab, i)


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_adds_to_the_listed_tokens_of_its_rows_only() -> None:
    logits = random_logits(3)
    rows = [make_row(SamplingParams(logit_bias={4: 2.5, 7: -100})), make_row(), make_row(SamplingParams(
        logit_bias={4: 1.0}))]
    biased = apply_logit_bias(logits, rows)
    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 7] -= 100
    expected[2, 4] += 1.0
    assert torch.equal(biased, expected)
    assert apply_logit_bias(logits, [make_row(), make_row()]) is logits  # no bias: the same tensor


def test_a_bias_of_minus_100_bans_the_argmax_in_bf16_logits_too() -> None:
    logits = random_logits(2).to(torch.bfloat16)
    top = logits[0].float().argmax().item()
    rows = [make_row(SamplingParams(temperature=0, logit_bias={top: -100})), make_row(SamplingParams(temperature=0))]
    out = Sampler().sample(logits, rows)
    assert out.token_ids[0] != top and out.token_ids[1] == logits[1].float().argmax().item()
