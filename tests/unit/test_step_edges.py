"""The decode step's edge kernels (kernels/triton/step_edges.py) under TRITON_INTERPRET=1, against torch."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from dflash2.kernels.triton import step_edges  # noqa: E402


def test_resolve_tokens_replaces_placeholders():
    future = torch.tensor([11, 22, 33, 44], dtype=torch.long)
    ids = torch.tensor([5, -1, 7, -4, -2, 0, 9], dtype=torch.long)
    assert step_edges.resolve_tokens(ids, future).tolist() == [5, 11, 7, 44, 22, 0, 9]
    assert step_edges.resolve_tokens(ids[:0], future).shape == (0,)


@pytest.mark.parametrize("vocab", [4096, 10000, 3 * 4096 + 1])
def test_greedy_argmax_matches_torch(vocab):
    """Every row's first index among equal maxima, as torch.argmax: a row whose maximum sits in two chunks
    (the earlier chunk wins), one with a tie inside a chunk, one whose maximum is the last entry, random rows;
    bf16 and float32 logits."""
    g = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, vocab, generator=g).to(dtype)
        logits[0, [7, vocab - 3]] = 50.0                      # two chunks (or one, at 4096) hold the maximum
        logits[1, [100, 101]] = 50.0                          # a tie inside one chunk
        logits[2, vocab - 1] = 50.0                           # the very last entry
        got = step_edges.greedy_argmax(logits)
        assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1)), (dtype, got)
        # a second call: the tickets were reset by the first
        assert torch.equal(step_edges.greedy_argmax(logits[3:]), logits[3:].argmax(dim=-1))


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_argmax_stores_future_slots(kernel):
    """future = (slots, base): row r's token also goes to slots[base + r], only within that half of the slots
    (rows past it are a padded graph's: no real request's); the other half is left as it was. kernel: the
    Triton argmax, else the sampler's torch path (the CPU's)."""
    from dflash2.engine.sampler import greedy_argmax

    argmax = step_edges.greedy_argmax if kernel else greedy_argmax
    logits = torch.randn(5, 5000, generator=torch.Generator().manual_seed(3))
    for base in (0, 4):
        slots = torch.full((8,), -7, dtype=torch.long)
        got = argmax(logits, (slots, torch.tensor([base])))
        assert torch.equal(got, logits.argmax(dim=-1))
        want = torch.full((8,), -7, dtype=torch.long)
        want[base:base + 4] = got[:4]
        assert torch.equal(slots, want)


def test_greedy_argmax_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="at most 64 rows"):
        step_edges.greedy_argmax(torch.zeros(65, 128))
    with pytest.raises(ValueError, match="contiguous"):
        step_edges.greedy_argmax(torch.zeros(128, 4).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_embed_tokens_resolves_placeholders_and_gathers_rows(dtype):
    """The graph's lookup: placeholders -(i + 1) resolved from the future slots and the 16-bit table's rows
    gathered in one launch, bit for bit the rows torch's embedding gives (hidden 600: a masked last block)."""
    table = torch.randn(50, 600, generator=torch.Generator().manual_seed(1)).to(dtype)
    future = torch.tensor([11, 22, 33, 44], dtype=torch.long)
    ids = torch.tensor([5, -1, 7, -4, -2, 0, 49], dtype=torch.long)
    resolved = torch.tensor([5, 11, 7, 44, 22, 0, 49])
    got = step_edges.embed_tokens(ids, table, dtype, future)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), table[resolved].view(torch.int16))
    plain = step_edges.embed_tokens(resolved, table, torch.float32)  # no future slots: ids as they are
    assert torch.equal(plain, table[resolved].float())
    assert step_edges.embed_tokens(ids[:0], table, dtype, future).shape == (0, 600)
    with pytest.raises(ValueError, match="unit last stride"):
        step_edges.embed_tokens(ids, table.t(), dtype, future)
