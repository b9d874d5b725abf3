"""Whole-step CUDA graphs at padded shapes: the shapes captured, the input block the host packs, and (without
CUDA: the same padded steps run eagerly, Triton interpreted) the engine's tokens against the torch backend."""
from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.engine.graphs import GraphShape, StepGraphs, graph_batch_sizes, mixed_graph_shapes, pack_inputs  # noqa: E402
from dflash2.engine.plan import ScheduledChunk  # noqa: E402
from dflash2.engine.host_batch import HostBatch  # noqa: E402
import torch  # noqa: E402


def test_mixed_graph_shapes_are_powers_of_two_then_steps_up_to_the_limits():
    assert mixed_graph_shapes(6, 40) == [(d, p) for d in (0, 1, 2, 4, 6) for p in (16, 32, 40)]
    # W7's device defaults: no mixed step pads its decode rows by more than 127 or its prefill by more than 255
    assert mixed_graph_shapes(512, 2048) == [(d, p) for d in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)
                                             for p in (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)]
    assert mixed_graph_shapes(32, 0) == []
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_graph_shape_sizes_its_sections():
    shape = GraphShape.of(decodes=4, prefill_tokens=32, max_slots=6, block_m=16)
    assert (shape.max_segments, shape.num_blocks, shape.tokens, shape.logit_rows) == (6, 2 + 6, 36, 10)
    assert shape.sections == [("ids", 36), ("positions", 36), ("slots", 36), ("lengths", 4), ("logit_rows", 10),
                              ("query_starts", 8), ("context_lens", 7), ("segment_slots", 7),
                              ("block_segments", 8), ("block_starts", 8), ("future_base", 1)]
    decode_only = GraphShape.of(decodes=8, prefill_tokens=0, max_slots=6, block_m=16)
    assert decode_only.sections == [("ids", 8), ("positions", 8), ("slots", 8), ("lengths", 8), ("future_base", 1)]
    assert decode_only.size == 33


def chunk(request_id: str, start: int, token_ids: tuple[int, ...], slot: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(request_id, start, token_ids, slot=slot, new_pages_start=0, new_page_ids=(), sample=sample)


def test_pack_inputs_pads_decode_rows_prefill_rows_segments_and_blocks():
    chunks = [
        chunk("d0", 9, (-1,), slot=3),  # a decode whose input is the previous step's token
        chunk("d1", 4, (70,), slot=0),
        chunk("p0", 0, (11, 12, 13), slot=1, sample=False),  # first chunk of a longer prompt
        chunk("p1", 5, (21, 22), slot=2),  # last chunk: samples
    ]
    host = HostBatch.build(chunks, num_decodes=2)
    shape = GraphShape.of(decodes=4, prefill_tokens=8, max_slots=3, block_m=2)  # S = 3, B = 4 + 3
    pad = 9
    packed = pack_inputs(shape, host, num_decodes=2, pad_slot=pad, block_m=2, future_base=3)
    assert len(packed) == shape.size
    expected = (
        [-1, 70, 0, 0, 11, 12, 13, 21, 22, 0, 0, 0]  # ids: 2 decodes, 2 padding, 5 prefill rows, 3 padding
        + [9, 4, 0, 0, 0, 1, 2, 5, 6, 0, 0, 0]  # positions
        + [3, 0, pad, pad, 1, 1, 1, 2, 2, pad, pad, pad]  # slots
        + [10, 5, 1, 1]  # decode lengths
        + [0, 1, 8, 0, 0, 0, 0]  # logit rows (D + S): the decodes, p1's last row (prefill row 4 after 4 rows)
        + [0, 3, 5, 5, 5]  # query starts within the prefill rows, then the empty segment 2
        + [3, 7, 0, 0]  # context lengths
        + [1, 2, pad, pad]  # segment slots
        + [0, 0, 1, 2, 2, 2, 2]  # block segments: p0 in 2 blocks of 2, p1 in 1, then the empty segment
        + [0, 2, 0, 0, 0, 0, 0]  # block starts
        + [3]  # where the sampled tokens go in the runner's future slots
    )
    assert packed == expected
    decode_only = GraphShape.of(decodes=2, prefill_tokens=0, max_slots=3, block_m=2)
    decodes = HostBatch.build(chunks[:2], num_decodes=2)
    assert pack_inputs(decode_only, decodes, 2, pad, 2, future_base=3) == [-1, 70, 9, 4, 3, 0, 10, 5, 3]


@pytest.mark.parametrize("length", ["min_tokens", "ignore_eos"])
def test_padded_step_shapes_give_the_torch_backends_tokens(tmp_path, length):
    """The engine with every step at a padded graph shape (decode-only and mixed; run eagerly here, captured
    on the GPU) gives the torch backend's greedy tokens: chunked prefill next to decodes, prefix hits. With
    min_tokens the sampler masks EOS and takes its own argmax; with ignore_eos the steps' greedy tokens are the
    graphs' own, which they also store into the runner's future slots (the runner copies nothing then): the
    engine runs overlapped, so every next step's inputs are those slots' placeholders."""
    from dflash2 import LLM, SamplingParams
    from tests.tiny_models import build_tiny_model

    build_tiny_model("qwen3", str(tmp_path))
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (3, 11, 12, 7)]
    params = SamplingParams(max_tokens=6, temperature=0, **({"min_tokens": 6} if length == "min_tokens"
                                                            else {"ignore_eos": True}))
    options = dict(page_bytes=4096, prefill_chunk_size=5, max_num_batched_tokens=16, kv_cache_memory=64 * 4096,
                   max_model_len=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(prompts, params)]
    llm = LLM(str(tmp_path), attention_backend="triton", overlap=True, **options)
    runner = llm.engine.runner
    runner.graphs = StepGraphs(runner, graph_batch_sizes(4), mixed_graph_shapes(4, 16), capture=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    used = runner.graphs.replays
    assert any(s.decodes and s.prefill_tokens for s in used)  # decodes next to prefill chunks
    assert any(not s.prefill_tokens for s in used) and any(not s.decodes for s in used)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # from cached prefixes
    assert again == expected and llm.engine.kv.num_prefix_hits > 0


def test_a_single_short_stream_takes_the_short_graph_until_it_grows(tmp_path):
    """One stream decodes in the short graph (the Triton backend's SHORT_SPLITS x SHORT_CONFIG attention) while
    its length is at most short_max_tokens (lowered to 9 here), then in the plain one-row graph: the torch
    backend's greedy tokens throughout. The tiny model is float32, whose cache the short decode does not take by
    itself: the instance is told it does."""
    from dflash2 import LLM, SamplingParams
    from tests.tiny_models import build_tiny_model

    build_tiny_model("qwen3", str(tmp_path))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    options = dict(page_bytes=4096, prefill_chunk_size=8, max_num_batched_tokens=16, kv_cache_memory=64 * 4096,
                   max_model_len=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(prompts, params)]
    llm = LLM(str(tmp_path), attention_backend="triton", **options)
    runner = llm.engine.runner
    runner.attention.short_decode = lambda dtype: True
    runner.attention.short_max_tokens = 9
    runner.graphs = StepGraphs(runner, graph_batch_sizes(4), mixed_graph_shapes(4, 16), capture=False)
    assert runner.graphs.short_max_tokens == 9
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    used = runner.graphs.replays
    short = [s for s in used if s.short]
    assert [(s.decodes, s.prefill_tokens) for s in short] == [(1, 0)] and used[short[0]] == 4  # lengths 6-9
    assert used[GraphShape.of(1, 0, runner.options.max_slots, runner.graphs.block_m)] == 5  # lengths 10-14


def test_the_eager_warm_up_starts_from_zeroed_future_slots_and_leaves_pages_and_outputs_as_they_were(tiny_llama):
    """runner.warm_up_eager (run after graph capture on CUDA) on the torch backend: steps on the spare slot only."""
    from dflash2 import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [7 + i for i in range(n)]} for n in (4, 9)]
    params = SamplingParams(max_tokens=5, min_tokens=5, temperature=0)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, max_num_seqs=8).generate(prompts, params)]
    llm = LLM(tiny_llama, max_num_seqs=8)
    runner = llm.engine.runner
    # a graph warm-up's padding row can leave any id in a future slot; the warm-up's placeholders read slot 0
    runner.future_tokens[0] = runner.model.arch.vocab_size + 7
    runner.warm_up_eager()
    assert llm.engine.pool.num_used == 0 and not runner.future_tokens.any()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
