"""Triton attention kernels under TRITON_INTERPRET=1 on the CPU, against the torch reference."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
# the interpreter warns about log(0) = -inf and numpy scalar conversions
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from dflash2.kernels.attention_metadata import AttentionMetadata, KVCache  # noqa: E402
from dflash2.kernels.torch_ref import attention as ref  # noqa: E402
from dflash2.kernels.triton import attention as tri  # noqa: E402
from dflash2.kernels.triton import kv_write  # noqa: E402
from tests.paging import mixed_batch_metadata, random_page_table  # noqa: E402

HEAD_DIM = 16
NUM_KV_HEADS = 2
TOKENS_PER_PAGE = 5  # deliberately not a power of two


def make_cache(num_pages: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def page_table_for(lengths: list[int], num_pages: int, seed: int) -> torch.Tensor:
    return random_page_table(lengths, TOKENS_PER_PAGE, num_pages, seed)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(group, num_splits):
    lengths = [1, 7, 23, 64, 130]
    k_cache, v_cache = make_cache(80, seed=group)
    table = page_table_for(lengths, 80, seed=num_splits)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, HEAD_DIM)
    slots = torch.arange(len(lengths), dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    expected = ref.decode_attention(q, k_cache, v_cache, table, slots, lens, max(lengths), 0.25)
    got = tri.decode_attention(q, k_cache, v_cache, table, slots, lens, 0.25, num_splits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_places_tokens_in_their_pages():
    k_cache, v_cache = torch.zeros(12, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM), torch.zeros(12, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM)
    table = page_table_for([12, 9], 12, seed=1)
    slots = torch.tensor([0, 0, 1, 0, 1], dtype=torch.int32)
    positions = torch.tensor([0, 11, 8, 5, 4])
    k = torch.randn(5, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(5, NUM_KV_HEADS, HEAD_DIM)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, expected_k, expected_v, table, slots, positions)
    kv_write.write_kv(k, v, k_cache, v_cache, table, slots, positions)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert expected_k.abs().sum() > 0


@pytest.mark.parametrize("group", [1, 2])
def test_mixed_batch_matches_reference(group):
    """Two decodes, a chunk continuing a cached prefix, and a fresh prompt longer than one query block."""
    num_heads = NUM_KV_HEADS * group
    # (context_len, query_len) per request: decodes have query_len 1
    shapes = [(17, 1), (40, 1), (33, 9), (70, 70)]
    lengths = [c for c, _ in shapes]
    k_cache, v_cache = make_cache(64, seed=7)
    table = page_table_for(lengths, 64, seed=3)
    num_tokens = sum(qlen for _, qlen in shapes)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    meta = mixed_batch_metadata(shapes, table, tri.PREFILL_BLOCK_M)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ref.TorchAttention().forward(q, k, v, KVCache(k_ref, v_ref), meta, 0.3)
    got = tri.TritonAttention(num_sms=4).forward(q, k, v, KVCache(k_cache, v_cache), meta, 0.3)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tiny_model_with_triton_backend_matches_torch_backend(tmp_path):
    """The whole engine on the Triton backend (interpreted): chunked prefill, prefix hits, decode; before it, the
    eager warm-up a CUDA runner runs after capturing its graphs (steps on the spare slot) changes nothing."""
    from dflash2 import LLM, SamplingParams
    from tests.tiny_models import build_tiny_model

    build_tiny_model("qwen2", str(tmp_path))
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (3, 11, 12)]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    options = dict(page_bytes=2048, prefill_chunk_size=5, max_num_batched_tokens=16, kv_cache_memory=64 * 2048,
                   max_model_len=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(prompts, params)]
    llm = LLM(str(tmp_path), attention_backend="triton", **options)
    runner = llm.engine.runner
    runner.warm_up_eager()  # decode rows 0, 1, 2, 4 beside a prefill chunk, all on the scratch page
    assert llm.engine.pool.num_used == 0 and runner.future_base == 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # now from cached prefixes
    assert again == expected
    assert llm.engine.kv.num_prefix_hits > 0


def test_fused_rotary_write_matches_rotary_then_write():
    from dflash2.config import RopeConfig
    from dflash2.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), HEAD_DIM, 64)
    num_heads = NUM_KV_HEADS * 2
    qkv = torch.randn(5, (num_heads + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q = qkv[:, : num_heads * HEAD_DIM].view(5, num_heads, HEAD_DIM)
    k = qkv[:, num_heads * HEAD_DIM: (num_heads + NUM_KV_HEADS) * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (num_heads + NUM_KV_HEADS) * HEAD_DIM:].view(5, NUM_KV_HEADS, HEAD_DIM)
    table = page_table_for([12, 9], 12, seed=2)
    meta = AttentionMetadata(page_table=table, token_slots=torch.tensor([0, 0, 1, 0, 1], dtype=torch.int32),
                             positions=torch.tensor([0, 11, 8, 5, 4]))
    expected_q, expected_k = rotary(meta.positions, q.clone(), k.clone())
    k_ref, v_ref = torch.zeros(12, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM), torch.zeros(12, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM)
    ref.write_kv(expected_k, v, k_ref, v_ref, table, meta.token_slots, meta.positions)
    k_cache, v_cache = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
    kv_write.rotary_write_kv(q, k, v, KVCache(k_cache, v_cache), rotary.cos, rotary.sin, meta)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype, num_sms, qk_norm", [
    (torch.float32, 4, False), (torch.float32, 132, False), (torch.bfloat16, 4, False), (torch.bfloat16, 132, False),
    (torch.float32, 4, True), (torch.float32, 132, True),
])
def test_decode_rotary_matches_the_rotary_kernel_then_attention(dtype, num_sms, qk_norm):
    """forward_rotary on a float cache: decode rows rotated and written by decode attention itself (prefill rows
    by the rotary kernel) against rotary_write_kv then attention, in a mixed batch whose decode lengths put the
    step's token first, inside and last in its split (num_sms sets the splits: 1, or many, where the first
    tile's pages are looked up before the PDL wait); the caches bit for bit. qk_norm (Qwen3): q and k RMS-normed
    per head first, in decode attention too (its statistics summed in another order than the rotary write's
    halves: the cache equal to float32 rounding)."""
    from dflash2.config import RopeConfig
    from dflash2.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), HEAD_DIM, 128)
    group = 3
    shapes = [(1, 1), (17, 1), (33, 1), (64, 1), (101, 1), (33, 9), (20, 20)]
    lengths = [c for c, _ in shapes]
    k_cache, v_cache = (c.to(dtype) for c in make_cache(96, seed=11))
    table = page_table_for(lengths, 96, seed=4)
    num_tokens = sum(qlen for _, qlen in shapes)
    g = torch.Generator().manual_seed(12)
    width = (NUM_KV_HEADS * group + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=g).to(dtype)
    meta = mixed_batch_metadata(shapes, table, tri.PREFILL_BLOCK_M)
    norms = None
    if qk_norm:
        q_w, k_w = ((torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype) for _ in range(2))
        norms = (q_w, k_w, 1e-6)

    def run(fused: bool):
        x = qkv.clone()
        q, k, v = x.split([NUM_KV_HEADS * group * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)
        q, k, v = (t.reshape(num_tokens, -1, HEAD_DIM) for t in (q, k, v))
        cache = KVCache(k_cache.clone(), v_cache.clone())
        attention = tri.TritonAttention(num_sms=num_sms)
        if fused:
            return attention.forward_rotary(q, k, v, cache, meta, 0.3, rotary.cos, rotary.sin, norms), cache
        kv_write.rotary_write_kv(q, k, v, cache, rotary.cos, rotary.sin, meta, norms)
        return attention._attend(q, cache, meta, 0.3), cache

    expected, expected_cache = run(False)
    got, cache = run(True)
    if qk_norm:
        torch.testing.assert_close(cache.k, expected_cache.k, atol=1e-6, rtol=1e-6)
        assert torch.equal(cache.v, expected_cache.v)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    as_bits = (lambda t: t.view(torch.int16)) if dtype == torch.bfloat16 else (lambda t: t)
    assert torch.equal(as_bits(cache.k), as_bits(expected_cache.k))
    assert torch.equal(as_bits(cache.v), as_bits(expected_cache.v))
    assert not torch.equal(cache.k, k_cache)  # the step's tokens were written
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # the interpreter's bf16 rotary values are not numbers to compare (their bits are the same above)
        assert torch.equal(as_bits(got[5:]), as_bits(expected[5:]))  # prefill rows: the same kernels


def test_fused_qk_norm_rotary_write_matches_the_norm_kernel_then_rotary_write(dtype=torch.float32):
    """Qwen3's q/k norms inside the rotary KV write give what qk_rms_norm_ and then the rotary write give
    (float32 here: the interpreter's bf16 arithmetic yields NaNs in either kernel; tests/gpu checks bf16)."""
    from dflash2.config import RopeConfig
    from dflash2.kernels.triton.elementwise import qk_rms_norm_
    from dflash2.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), HEAD_DIM, 64)
    num_heads = NUM_KV_HEADS * 2
    g = torch.Generator().manual_seed(4)
    q = (3 * torch.randn(5, num_heads, HEAD_DIM, generator=g)).to(dtype)
    k = (3 * torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=g)).to(dtype)
    v = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    q_w, k_w = (torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype), (torch.rand(HEAD_DIM, generator=g) + 0.5).to(dtype)
    table = page_table_for([12, 9], 12, seed=2)
    meta = AttentionMetadata(page_table=table, token_slots=torch.tensor([0, 0, 1, 0, 1], dtype=torch.int32),
                             positions=torch.tensor([0, 11, 8, 5, 4]))
    shape = (12, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM)
    q_ref, k_ref = q.clone(), k.clone()
    qk_rms_norm_(q_ref, k_ref, q_w, k_w, 1e-6)
    ref_cache = KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    kv_write.rotary_write_kv(q_ref, k_ref, v, ref_cache, rotary.cos, rotary.sin, meta)
    cache = KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    kv_write.rotary_write_kv(q, k, v, cache, rotary.cos, rotary.sin, meta, qk_norm=(q_w, k_w, 1e-6))
    assert not torch.equal(q, q_ref.new_zeros(q.shape))
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-6, rtol=1e-6)
    assert torch.equal(cache.v, ref_cache.v)


@pytest.mark.parametrize("group, block_n, num_warps", [
    # each tile (sub-tiles x tokens: 2 x 16, 4 x 16, 1 x 64, 1 x 16) with two of the GQA groups, each group
    # (1: one head column; 3: padded to 4, one masked; 4: full) with two or more tiles (all 12 pairs: 48 s
    # interpreted): the loop branches on neither, only its tensor shapes follow them.
    (1, 32, 2), (3, 32, 2),
    (4, 64, 4), (3, 64, 4),
    (1, 64, 1), (4, 64, 1),
    (3, 16, 2), (4, 16, 2),
])
def test_int8_imma_t_decode_matches_reference(group, block_n, num_warps):
    """The imma_t loop (tokens as the mma's M side, heads as N, one token sub-tile of BLOCK_N / sub-tiles per warp
    with its own softmax, merged after the loop; V as fp16 x + 1152 with 1152 x the probability sums taken off)
    at head_dim 32 (an int8 mma's k step) for GQA groups padded to 1, 4 and 4 columns, against the float32
    reference and the imma loop, whose q quantization it shares. Lengths leave sub-tiles empty for whole
    programs (1, 7 tokens; 3 splits), end mid sub-tile and cross pages of 5 tokens."""
    dim, lengths = 32, [1, 7, 23, 64, 130, 200]
    g = torch.Generator().manual_seed(group * 100 + block_n)
    shape = (100, TOKENS_PER_PAGE, NUM_KV_HEADS, dim)
    k_cache, v_cache = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = ((torch.rand(shape[:3], generator=g) * 0.05 + 0.01).half() for _ in range(2))
    table = page_table_for(lengths, 100, seed=group)
    q = (torch.randn(len(lengths), NUM_KV_HEADS * group, dim, generator=g) * 3).bfloat16()
    slots, lens = torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
    args = (k_cache, v_cache, table, slots, lens)
    expected = ref.decode_attention(q.float(), *args, max(lengths), 0.2, k_scale, v_scale)
    for num_splits in (1, 3):
        got = tri.decode_attention(q, *args, 0.2, num_splits, k_scale=k_scale, v_scale=v_scale,
                                   config={"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 2,
                                           "int8": "imma_t"}).float()
        assert bool(torch.isfinite(got).all())
        error = float((got - expected).norm() / expected.norm())
        assert error < 6e-3, error


@pytest.mark.parametrize("path", ["imma_t", "legacy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_int8_decode_loops_match_reference(path, dtype, num_splits):
    """The int8 decode loops on a random int8 cache with fp16 row scales, forced by the config's "int8" key:
    "imma_t" (q as two int8 terms, integer K.q dots, V scale in the probabilities; the interpreter
    computes the same values as the PTX) and "legacy" (tiles dequantized to fp16; float32 q keeps float32
    tiles), many tiles
    over pages of 5 tokens. Against the float32 reference on the same cache: the imma path's q has ~15 bits
    (~2e-5 here in float32), below bf16's own rounding of the output (~3e-3)."""
    lengths = [1, 7, 23, 64, 130]
    g = torch.Generator().manual_seed(11)
    shape = (80, TOKENS_PER_PAGE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = ((torch.rand(shape[:3], generator=g) * 0.05 + 0.01).half() for _ in range(2))
    table = page_table_for(lengths, 80, seed=5)
    q = (torch.randn(len(lengths), NUM_KV_HEADS * 2, HEAD_DIM, generator=g) * 3).to(dtype)
    slots, lens = torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
    args = (k_cache, v_cache, table, slots, lens)
    expected = ref.decode_attention(q.float(), *args, max(lengths), 0.25, k_scale, v_scale)
    config = {"BLOCK_N": 16, "num_warps": 2, "num_stages": 2, "int8": path}
    got = tri.decode_attention(q, *args, 0.25, num_splits, k_scale=k_scale, v_scale=v_scale, config=config)
    error = float((got.float() - expected).norm() / expected.norm())
    assert error < (2e-4 if dtype == torch.float32 else 6e-3), error


@pytest.mark.parametrize("length", [1, 5, 128, 129, 300, 512, 700])
def test_short_decode_merges_only_the_used_splits(length):
    """The short graph's decode (SHORT_SPLITS splits of SHORT_CONFIG's 128-token tiles): the splits past the
    length leave before their wait and take no ticket, the used ones merge; past SHORT_MAX_TOKENS (700) a split
    loops over several tiles. Against the reference (fp16: the interpreter's bf16 dots are not numbers to
    compare), twice (the tickets reset)."""
    assert (tri.SHORT_SPLITS, tri.SHORT_CONFIG, tri.SHORT_MAX_TOKENS) == (
        4, {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1, "KV_PREFETCH": 1}, 512)
    group = 4
    k_cache, v_cache = (c.half() for c in make_cache(160, seed=length))
    table = page_table_for([length], 160, seed=3)
    q = torch.randn(1, NUM_KV_HEADS * group, HEAD_DIM, generator=torch.Generator().manual_seed(length)).half()
    slots = torch.zeros(1, dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, slots, lens, length, 0.25)
    for _ in range(2):
        got = tri.decode_attention(q, k_cache, v_cache, table, slots, lens, 0.25, tri.SHORT_SPLITS,
                                   config=tri.SHORT_CONFIG)
        torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


def test_kv_prefetch_lines_only_where_asked_on_early_pages_of_a_float_cache():
    """kv_prefetch_lines: a row's 128-byte lines (at least one) where the config asks (SHORT_CONFIG does), the
    pages are looked up before the wait on a float cache, and inline PTX runs (never under the interpreter)."""
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 128, 2, True, asm=True) == 2
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 128, 4, True, asm=True) == 4
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 32, 2, True, asm=True) == 1
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 128, 2, False, asm=True) == 0
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 128, 2, True, asm=False) == 0
    assert tri.kv_prefetch_lines(tri.DECODE_CONFIG, 128, 2, True, asm=True) == 0
    assert tri.kv_prefetch_lines(tri.SHORT_CONFIG, 128, 2, True) == 0  # these tests run interpreted


def test_short_decoding_sets_the_split_count_and_config_inside_only():
    attention = tri.TritonAttention(num_sms=132)
    assert attention.short_decode(torch.bfloat16) and attention.short_decode(torch.float16)
    assert not attention.short_decode(torch.float32) and not attention.short_decode(torch.int8)
    with attention.short_decoding():
        assert (attention.graph_num_splits, attention.graph_decode_config) == (tri.SHORT_SPLITS, tri.SHORT_CONFIG)
    assert (attention.graph_num_splits, attention.graph_decode_config) == (None, None)


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 5])
def test_eager_prefill_metadata_rows_start_on_16_bytes(tmp_path, segments):
    """Triton compiles a kernel variant per pointer alignment: the eager step's prefill metadata rows (one packed
    tensor each) start on 16 bytes whatever the number of chunks, so the prefill kernel compiles once."""
    from dflash2 import LLM
    from dflash2.engine.host_batch import HostBatch
    from dflash2.engine.plan import ScheduledChunk
    from tests.tiny_models import build_tiny_model

    build_tiny_model("qwen2", str(tmp_path))
    runner = LLM(str(tmp_path), attention_backend="triton", page_bytes=2048, max_model_len=64,
                 max_num_seqs=8).engine.runner
    chunks = [ScheduledChunk("d", 3, (7,), 0, 0, (), True)]
    chunks += [ScheduledChunk(f"p{i}", 0, (5,) * (i + 2), i + 1, 0, (), True) for i in range(segments)]
    meta = runner._metadata(HostBatch.build(chunks, 1), 1)
    rows = (meta.prefill_query_starts, meta.prefill_context_lens, meta.prefill_slots, meta.prefill_block_segments,
            meta.prefill_block_starts)
    assert all(row.data_ptr() % 16 == 0 for row in rows)
    assert meta.prefill_query_starts.tolist() == [sum(range(2, i + 2)) for i in range(segments + 1)]
    assert meta.prefill_context_lens.tolist() == [i + 2 for i in range(segments)]
    assert meta.prefill_slots.tolist() == list(range(1, segments + 1))
    assert meta.prefill_block_segments.tolist() == list(range(segments))  # one query block a chunk (< block_m)
    assert meta.prefill_block_starts.tolist() == [0] * segments
