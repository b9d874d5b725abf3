"""On a CUDA device: Triton kernels against the torch reference in bf16, graphs against eager, overlap
against the plain loop, and the engine against transformers on a tiny model."""
from __future__ import annotations

import random

import pytest
import torch

from tests.paging import mixed_batch_metadata, random_page_table

pytestmark = pytest.mark.gpu


def _cache(num_pages: int, tokens_per_page: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_pages, tokens_per_page, kv_heads, dim)
    return (torch.randn(shape, generator=g, device="cuda").bfloat16(),
            torch.randn(shape, generator=g, device="cuda").bfloat16())


def _table(lengths: list[int], tokens_per_page: int, num_pages: int, seed: int) -> torch.Tensor:
    return random_page_table(lengths, tokens_per_page, num_pages, seed, device="cuda")


@pytest.mark.parametrize("group, dim, tokens_per_page", [(2, 128, 18), (4, 128, 16), (3, 64, 45)])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_kernel_matches_reference(group, dim, tokens_per_page, num_splits):
    from dflash2.kernels.torch_ref import attention as ref
    from dflash2.kernels.triton import attention as tri

    rng = random.Random(group * 100 + num_splits)
    lengths = [1, 2, 17, 300, 1025, 4099] + [rng.randrange(1, 3000) for _ in range(26)]
    kv_heads = 8
    num_pages = sum(-(-n // tokens_per_page) for n in lengths) + 4
    k_cache, v_cache = _cache(num_pages, tokens_per_page, kv_heads, dim, seed=group)
    table = _table(lengths, tokens_per_page, num_pages, seed=num_splits)
    q = torch.randn(len(lengths), kv_heads * group, dim, device="cuda").bfloat16()
    slots = torch.arange(len(lengths), dtype=torch.int32, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, slots, lens, max(lengths),
                                    dim ** -0.5)
    got = tri.decode_attention(q, k_cache, v_cache, table, slots, lens, dim ** -0.5, num_splits)
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 1e-2, error


@pytest.mark.parametrize("group", [2, 4])
def test_mixed_batch_kernels_match_reference(group):
    from dflash2.kernels.attention_metadata import KVCache
    from dflash2.kernels.torch_ref.attention import TorchAttention
    from dflash2.kernels.triton import attention as tri

    dim, kv_heads, tokens_per_page = 128, 8, 16
    shapes = [(700, 1), (33, 1), (1500, 300), (513, 513), (90, 7)]  # (context, query) per request
    lengths = [c for c, _ in shapes]
    num_pages = sum(-(-n // tokens_per_page) for n in lengths) + 2
    k_cache, v_cache = _cache(num_pages, tokens_per_page, kv_heads, dim, seed=group)
    table = _table(lengths, tokens_per_page, num_pages, seed=3)
    total = sum(q for _, q in shapes)
    q = torch.randn(total, kv_heads * group, dim, device="cuda").bfloat16()
    k = torch.randn(total, kv_heads, dim, device="cuda").bfloat16()
    v = torch.randn(total, kv_heads, dim, device="cuda").bfloat16()
    meta = mixed_batch_metadata(shapes, table, tri.PREFILL_BLOCK_M)
    k_ref, v_ref = k_cache.float(), v_cache.float()
    expected = TorchAttention().forward(q.float(), k.float(), v.float(), KVCache(k_ref, v_ref), meta, dim ** -0.5)
    got = tri.TritonAttention().forward(q, k, v, KVCache(k_cache, v_cache), meta, dim ** -0.5)
    assert torch.equal(k_cache.float(), k_ref) and torch.equal(v_cache.float(), v_ref)
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 1e-2, error


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_rotary_matches_the_rotary_kernel_in_bf16(qk_norm):
    """forward_rotary (decode attention rotating and writing the decode rows' k and v, the first tile's pages read
    before the PDL wait) on llama-3-8b's attention shape (32 heads over 8 KV heads of 128, 16-token pages):
    decode rows of lengths 1..4099 at one row (16 splits) and 32 (2 splits), plus prefill chunks: the caches bit
    for bit and the output as the rotary kernel then attention give it. qk_norm: Qwen3's per-head q/k norms
    first, in decode attention too."""
    from dflash2.config import RopeConfig
    from dflash2.kernels.attention_metadata import KVCache
    from dflash2.kernels.triton import attention as tri
    from dflash2.kernels.triton.kv_write import rotary_write_kv
    from dflash2.layers.rotary import RotaryEmbedding

    dim, heads, kv_heads, tokens_per_page = 128, 32, 8, 16
    rotary = RotaryEmbedding(RopeConfig(theta=500000.0), dim, 8192).to("cuda")
    norms = None
    if qk_norm:
        norms = (torch.rand(dim, device="cuda").bfloat16() + 0.5, torch.rand(dim, device="cuda").bfloat16() + 0.5,
                 1e-6)
    rng = random.Random(7)
    for decodes in ([300], [1, 2, 17, 32, 33, 300, 1025, 4099] + [rng.randrange(1, 3000) for _ in range(24)]):
        shapes = [(n, 1) for n in decodes] + [(700, 64), (90, 90)]
        lengths = [c for c, _ in shapes]
        num_pages = sum(-(-n // tokens_per_page) for n in lengths) + 2
        k_cache, v_cache = _cache(num_pages, tokens_per_page, kv_heads, dim, seed=len(decodes))
        table = _table(lengths, tokens_per_page, num_pages, seed=5)
        total = sum(q for _, q in shapes)
        qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, device="cuda").bfloat16()
        meta = mixed_batch_metadata(shapes, table, tri.PREFILL_BLOCK_M)
        runs = []
        for fused in (False, True):
            q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
            q, k, v = q.view(total, heads, dim), k.view(total, kv_heads, dim), v.reshape(total, kv_heads, dim)
            cache = KVCache(k_cache.clone(), v_cache.clone())
            attention = tri.TritonAttention()
            if fused:
                out = attention.forward_rotary(q, k, v, cache, meta, dim ** -0.5, rotary.cos, rotary.sin, norms)
            else:  # the rotary kernel for every row, then attention
                rotary_write_kv(q, k, v, cache, rotary.cos, rotary.sin, meta, norms)
                out = attention._attend(q, cache, meta, dim ** -0.5)
            runs.append((out.float(), cache))
        (expected, expected_cache), (got, cache) = runs
        assert torch.equal(cache.v.view(torch.int16), expected_cache.v.view(torch.int16))
        k_diff = (cache.k.float() - expected_cache.k.float()).abs()
        # rotated k: the same operations as the rotary kernel's, which the compiler may contract differently:
        # one bf16 rounding of the result or of a product (|k| and the products of randn are below ~6)
        within_a_rounding = bool((k_diff <= expected_cache.k.float().abs() * 2 ** -7 + 0.05).all())
        assert within_a_rounding, (int((k_diff > 0).sum()), float(k_diff.max()))
        error = (got - expected).norm() / expected.norm()
        assert error < 2e-3, (len(decodes), float(error))  # the new token's score summed in another order


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    directory = str(tmp_path_factory.mktemp("tiny"))
    return build_tiny_model("llama", directory), directory


def test_graphs_overlap_and_eager_agree_with_transformers(tiny_llama):
    """Whole-step graphs (decode-only and mixed decode + prefill chunks), decode-only graphs, and eager give
    transformers' greedy tokens; requests of different lengths on 4 slots make steps that mix both (decode
    attention rotating and writing the decode rows' k and v itself, the first tile's pages before the wait)."""
    from dflash2 import LLM, SamplingParams
    from tests.tiny_models import hf_greedy

    hf_model, directory = tiny_llama
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0) for n in range(8, 20)]
    common = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128, kv_cache_memory="64MiB",
                  page_bytes=4096, prefill_chunk_size=16, max_num_batched_tokens=32)
    runs = {}
    for name, options in {"graphs+overlap": {}, "eager": dict(enforce_eager=True, overlap=False),
                          "graphs+sync": dict(overlap=False),
                          "decode graphs": dict(cuda_graph_max_prefill_tokens=0)}.items():
        llm = LLM(directory, **common, **options)
        graphs = llm.engine.runner.graphs
        assert (graphs is not None) == (name != "eager")
        runs[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.pool.num_used == 0
        if name.startswith("graphs"):
            assert any(s.decodes and s.prefill_tokens for s in graphs.replays)  # mixed steps were replayed
        if name == "decode graphs":
            assert graphs.replays and not any(s.prefill_tokens for s in graphs.replays)
    assert runs["graphs+overlap"] == runs["eager"] == runs["graphs+sync"] == runs["decode graphs"]
    assert runs["eager"] == [hf_greedy(hf_model, p, q.max_tokens) for p, q in zip(prompts, params)]


def test_graph_greedy_tokens_match_eager_sampling(tiny_llama):
    """Without min_tokens or penalties a graph step's tokens are the graph's own argmax (nothing launched after
    the replay to sample): the same tokens as eager steps, whose sampler takes the argmax after the forward
    (the step's edges single Triton launches in both: placeholders, argmax)."""
    from dflash2 import LLM, SamplingParams

    _, directory = tiny_llama
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))]} for _ in range(10)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in range(6, 16)]
    common = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128, kv_cache_memory="64MiB",
                  page_bytes=4096, prefill_chunk_size=16, max_num_batched_tokens=32)
    runs = {}
    for name, options in {"graphs": {}, "eager": dict(enforce_eager=True)}.items():
        llm = LLM(directory, **common, **options)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name == "graphs":
            assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert runs["graphs"] == runs["eager"]
    assert [len(t) for t in runs["eager"]] == list(range(6, 16))


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_with_swap_gives_transformers_tokens_on_the_gpu(tiny_llama, overlap):
    """Urgent arrivals on a small pool pause running requests: their pages go to pinned host pages (the
    copies to the host on a side stream) and come back, graphs on; every request's greedy tokens stay
    transformers'."""
    from dflash2 import LLM, SamplingParams
    from tests.engine_runs import run_with_urgent_arrivals
    from tests.tiny_models import hf_greedy

    hf_model, directory = tiny_llama
    rng = random.Random(7)
    low = [[rng.randrange(3, 256) for _ in range(rng.randrange(10, 40))] for _ in range(4)]
    high = [[rng.randrange(3, 256) for _ in range(rng.randrange(10, 40))] for _ in range(3)]
    params = SamplingParams(max_tokens=14, min_tokens=14, temperature=0)
    llm = LLM(directory, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=64, page_bytes=4096,
              kv_cache_memory=f"{12 * 4096}B", swap_space=f"{64 * 4096}B", prefill_chunk_size=16,
              max_num_batched_tokens=32, overlap=overlap)
    engine = llm.engine
    got = run_with_urgent_arrivals(engine, low, high, params, steps_before=4)
    assert engine.scheduler.num_swap_outs > 0
    assert got == [hf_greedy(hf_model, prompt, 14) for prompt in low + high]
    assert engine.pool.num_used == 0 and engine.kv.host_pool.num_swapped == 0


def test_step_trace_times_each_step_on_the_device(tiny_llama, tmp_path, monkeypatch):
    """DFLASH2_STEP_TRACE on CUDA (graphs, overlap): every step's line has its device time."""
    import json

    from dflash2 import LLM, SamplingParams
    from dflash2.engine.step_trace import ENV

    _, directory = tiny_llama
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(path))
    llm = LLM(directory, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=64, page_bytes=4096,
              kv_cache_memory="1MiB", prefill_chunk_size=16, max_num_batched_tokens=32)
    prompts = [[3 + i, 40 + i, 7, 9, 11] * (i + 1) for i in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(r["prefill_tokens"] + r["decodes"] for r in records) == sum(len(p) + 5 for p in prompts)
    assert all(r["device_ms"] is not None and r["device_ms"] > 0 for r in records)


def test_qwen3_graphs_agree_with_transformers(tmp_path):
    """Qwen3's q/k norms run as one in-place kernel on CUDA; bf16 logits feed the device argmax."""
    from dflash2 import LLM, SamplingParams
    from tests.tiny_models import build_tiny_model, hf_greedy

    hf_model = build_tiny_model("qwen3", str(tmp_path))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128,
              kv_cache_memory="64MiB", page_bytes=4096)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, min_tokens=16, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 16) for p in prompts]


def test_fused_qk_norm_rotary_write_matches_separate_kernels_in_bf16():
    """Qwen3's q/k norms inside the rotary KV write against qk_rms_norm_ then the rotary write (bf16): equal
    up to one bf16 rounding (the fused kernel sums a row's squares as two halves)."""
    from dflash2.config import RopeConfig
    from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache
    from dflash2.kernels.triton import kv_write
    from dflash2.kernels.triton.elementwise import qk_rms_norm_
    from dflash2.layers.rotary import RotaryEmbedding

    heads, kv_heads, dim, tokens_per_page = 16, 8, 128, 9
    rotary = RotaryEmbedding(RopeConfig(theta=1000000.0), dim, 512).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    q = (3 * torch.randn(40, heads, dim, generator=g, device="cuda")).bfloat16()
    k = (3 * torch.randn(40, kv_heads, dim, generator=g, device="cuda")).bfloat16()
    v = torch.randn(40, kv_heads, dim, generator=g, device="cuda").bfloat16()
    q_w = (torch.rand(dim, generator=g, device="cuda") + 0.5).bfloat16()
    k_w = (torch.rand(dim, generator=g, device="cuda") + 0.5).bfloat16()
    table = _table([300, 200], tokens_per_page, 64, seed=5)
    slots = torch.tensor([i % 2 for i in range(40)], dtype=torch.int32, device="cuda")
    positions = torch.arange(40, device="cuda") + 100 * slots  # distinct slots for every token
    meta = AttentionMetadata(page_table=table, token_slots=slots, positions=positions)
    shape = (64, tokens_per_page, kv_heads, dim)
    q_ref, k_ref = q.clone(), k.clone()
    qk_rms_norm_(q_ref, k_ref, q_w, k_w, 1e-6)
    ref_cache = KVCache(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"),
                        torch.zeros(shape, dtype=torch.bfloat16, device="cuda"))
    kv_write.rotary_write_kv(q_ref, k_ref, v, ref_cache, rotary.cos, rotary.sin, meta)
    cache = KVCache(torch.zeros_like(ref_cache.k), torch.zeros_like(ref_cache.v))
    kv_write.rotary_write_kv(q, k, v, cache, rotary.cos, rotary.sin, meta, qk_norm=(q_w, k_w, 1e-6))
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(cache.k.float(), ref_cache.k.float(), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(cache.v, ref_cache.v)


def test_device_sampling_is_seeded_and_respects_top_k(tiny_llama):
    from dflash2 import LLM, SamplingParams

    _, directory = tiny_llama
    llm = LLM(directory, device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128, kv_cache_memory="64MiB",
              page_bytes=4096)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=7)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params)
    second = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert first[0].outputs[0].token_ids == first[2].outputs[0].token_ids == second[0].outputs[0].token_ids


@pytest.mark.parametrize("rows", [5, 65])
def test_greedy_argmax_matches_torch_including_ties(rows):
    """Up to 64 rows the one-launch argmax of kernels/triton/step_edges.py; past them torch's reductions."""
    from dflash2.engine.sampler import greedy_argmax

    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(rows, 151936, device="cuda").to(dtype)
        logits[1, 70000] = logits[1, 90000] = 100.0  # a tie across chunks: the first index wins
        logits[2, 5] = logits[2, 6] = 100.0  # a tie inside one chunk
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
        assert greedy_argmax(logits)[1].item() == 70000 and greedy_argmax(logits)[2].item() == 5


def test_resolve_tokens_on_the_gpu():
    from dflash2.kernels.triton import step_edges

    future = torch.arange(100, 164, device="cuda")
    ids = torch.tensor([3, -1, -64, 0, -7, 12], device="cuda")
    assert step_edges.resolve_tokens(ids, future).tolist() == [3, 100, 163, 0, 106, 12]


def test_embed_tokens_on_the_gpu():
    from dflash2.kernels.triton import step_edges

    table = torch.randn(1000, 4096, device="cuda").bfloat16()
    future = torch.arange(100, 164, device="cuda")
    ids = torch.tensor([3, -1, -64, 0, -7, 999], device="cuda")
    resolved = torch.tensor([3, 100, 163, 0, 106, 999], device="cuda")
    assert torch.equal(step_edges.embed_tokens(ids, table, torch.bfloat16, future), table[resolved])


@pytest.mark.parametrize("length", [1, 100, 128, 129, 384, 512, 1000, 5000])
def test_short_decode_matches_reference(length):
    """The short graph's decode (W2): SHORT_SPLITS splits of SHORT_CONFIG's 128-token tiles, the splits past the
    length gone before their wait (no ticket), several tiles a split past SHORT_MAX_TOKENS; twice (the tickets
    reset), llama-3-8b's heads."""
    from dflash2.kernels.torch_ref import attention as ref
    from dflash2.kernels.triton import attention as tri

    tokens_per_page, kv_heads, group, dim = 16, 8, 4, 128
    num_pages = -(-length // tokens_per_page) + 4
    k_cache, v_cache = _cache(num_pages, tokens_per_page, kv_heads, dim, seed=length)
    table = _table([length], tokens_per_page, num_pages, seed=length)
    q = torch.randn(1, kv_heads * group, dim, device="cuda").bfloat16()
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([length], dtype=torch.int32, device="cuda")
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, slots, lens, length,
                                    dim ** -0.5)
    for _ in range(2):
        got = tri.decode_attention(q, k_cache, v_cache, table, slots, lens, dim ** -0.5, tri.SHORT_SPLITS,
                                   config=tri.SHORT_CONFIG)
        error = (got.float() - expected).norm() / expected.norm()
        assert error < 1e-2, error
