"""Structured output's run-time half: matchers catch up with sampled tokens (placeholders resolved), masks in
xgrammar's bit layout applied to the logits, and the sampler keeping every guided row inside its grammar."""
from __future__ import annotations

import pytest
import torch

from dflash2.engine.guided import GuidedState, TokenMask, TokenMasks, apply_token_mask
from dflash2.engine.sampler import Sampler, SamplingRow
from dflash2.sampling_params import SamplingParams
from dflash2.structured_outputs import StructuredOutputsParams

VOCAB = ["a", "b", "c", "ab", "<eos>", "x"]
VOCAB_SIZE = 40  # logits wider than the vocabulary, as models pad them: the extra ids are never allowed
EOS = 4


def matcher(regex: str):
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))


def allowed(bitmask_row: torch.Tensor) -> list[int]:
    return [i for i in range(VOCAB_SIZE) if (int(bitmask_row[i // 32]) >> (i % 32)) & 1]


def row(guided: GuidedState | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [], [], None, [EOS], guided=guided)


def test_apply_token_mask_follows_the_bit_layout_and_leaves_other_rows_alone():
    logits = torch.randn(3, VOCAB_SIZE)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | -(1 << 31)  # tokens 3 and 31 (the sign bit)
    bitmask[1, 1] = 1 << 2  # token 34
    masked = apply_token_mask(logits, TokenMask(bitmask, [0, 2]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [3, 31]
    assert torch.equal(masked[1], logits[1])
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [34]
    assert masked[0, 3] == logits[0, 3] and masked[2, 34] == logits[2, 34]


def test_a_mask_that_would_leave_no_finite_logit_leaves_the_row_as_it_was():
    logits = torch.randn(1, VOCAB_SIZE)
    logits[0, 4] = float("-inf")  # min_tokens banned EOS, the one token a finished grammar allows
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 4
    assert torch.equal(apply_token_mask(logits, TokenMask(bitmask, [0])), logits)


def test_matchers_catch_up_with_the_tokens_sampled_since_their_last_mask_placeholders_included():
    tokens = [9, 9, 3]  # a two-token prompt, then "ab"
    state = GuidedState(matcher("ab*c"), tokens, first_output=2)
    masks = TokenMasks(max_rows=4, vocab_size=VOCAB_SIZE, device=torch.device("cpu"))
    mask = masks.prepare([row(), row(state)], known=lambda t: t)
    assert mask.rows == [1] and allowed(mask.bitmask[0]) == [1, 2]  # after "ab": b or c
    tokens.append(-5)  # the previous step's token, not yet known on the host: future slot 4 holds "c"
    mask = masks.prepare([row(state)], known=lambda t: {-5: 2}.get(t, t))
    assert state.num_accepted == 2 and allowed(mask.bitmask[0]) == [EOS]  # complete: only EOS


def test_a_refused_token_unconstrains_the_rest_instead_of_failing_the_step():
    state = GuidedState(matcher("a"), [5], first_output=0)
    mask = TokenMasks(2, VOCAB_SIZE, torch.device("cpu")).prepare([row(state)], known=lambda t: t)
    assert state.broken and allowed(mask.bitmask[0]) == list(range(VOCAB_SIZE))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_keeps_guided_rows_in_their_grammar(temperature):
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 5] = 50.0  # "x", the model's favourite, is not in the grammar
    logits[:, 2] = 10.0
    state = GuidedState(matcher("(a|c)b"), [], first_output=0)
    rows = [row(state, temperature=temperature, seed=1), row(temperature=temperature, seed=1)]
    masks = TokenMasks(2, VOCAB_SIZE, torch.device("cpu"))
    for _ in range(5):
        token_ids = Sampler().sample_device(logits, rows, token_mask=masks.prepare(rows, lambda t: t)).tolist()
        assert token_ids[0] in (0, 2) and token_ids[1] == 5
    assert Sampler().sample_device(logits, rows).tolist() == [5, 5]  # no mask: the row is free


def test_structured_outputs_params_check_their_source():
    assert StructuredOutputsParams(choice=["a", 'b"c']).grammar_source().text == 'root ::= "a" | "b\\"c"'
    assert StructuredOutputsParams(grammar='start: "a"').grammar_source().kind == "lark"
    assert StructuredOutputsParams(grammar='root ::= "a"').grammar_source().kind == "ebnf"
    StructuredOutputsParams(grammar='start: "a" | "b"').check()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams().grammar_source()
    with pytest.raises(ValueError, match="invalid JSON schema"):
        StructuredOutputsParams(json={"type": "objekt"}).check()
    with pytest.raises(ValueError, match="structured_outputs needs exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
