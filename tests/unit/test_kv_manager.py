"""KVManager: page tables per request, growth, hashing of full computed pages, prefix reuse and freeing.

Pools are a few pages with `page_bytes=1`; every test checks free + cached + used == num_pages after every
operation.
"""
from __future__ import annotations

import pytest

from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.kv.prefix_hash import chain_hashes
from dflash2.request import Request
from dflash2.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int], prompt_logprobs: int | None = None) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs))


def make_kv(num_pages: int, tokens_per_page: int, namespace: str = "m", **kwargs: bool) -> KVManager:
    return KVManager(PagePool(num_pages, page_bytes=1), tokens_per_page, namespace, **kwargs)


def assert_state(pool: PagePool, *, free: int, cached: int, used: int) -> None:
    pool.check()
    assert pool.num_free + pool.num_cached + pool.num_used == pool.num_pages
    assert (pool.num_free, pool.num_cached, pool.num_used) == (free, cached, used)


def compute_all(kv: KVManager, request: Request) -> None:
    """What a finished prefill leaves behind: pages for every token, all computed and committed."""
    assert kv.grow(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)


def test_tokens_per_page_arithmetic() -> None:
    kv = make_kv(2, 4)
    assert [kv.num_pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9, 12, 13)] == [0, 1, 1, 1, 2, 2, 3, 3, 4]
    kv1 = make_kv(2, 1)
    assert [kv1.num_pages_for(n) for n in (0, 1, 7)] == [0, 1, 7]
    with pytest.raises(ValueError):
        make_kv(2, 0)


def test_grow_across_page_boundaries() -> None:
    kv = make_kv(6, 4)
    pool = kv.pool
    request = make_request("a", list(range(10)))
    assert kv.pages_of("a") == []
    assert kv.grow(request, 1)
    assert kv.pages_of("a") == [0]
    assert_state(pool, free=5, cached=0, used=1)
    assert kv.grow(request, 4)  # still fits in page 0
    assert kv.pages_of("a") == [0]
    assert_state(pool, free=5, cached=0, used=1)
    assert kv.grow(request, 5)  # token 4 starts page 1
    assert kv.pages_of("a") == [0, 1]
    assert_state(pool, free=4, cached=0, used=2)
    assert kv.grow(request, 10)
    assert kv.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=3, cached=0, used=3)
    assert kv.grow(request, 3)  # growing to fewer tokens never shrinks the table
    assert kv.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=3, cached=0, used=3)

    assert kv.can_grow(request, 24)  # 6 pages: 3 more, 3 available
    assert not kv.can_grow(request, 25)
    assert not kv.grow(request, 25)  # 7 pages > 6: nothing changes
    assert kv.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=3, cached=0, used=3)

    other = make_request("b", list(range(100, 105)))
    assert kv.grow(other, 5)
    assert kv.pages_of("b") == [3, 4]
    assert_state(pool, free=1, cached=0, used=5)
    assert not kv.grow(request, 20)  # needs 2 more, 1 available: all or nothing
    assert kv.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=1, cached=0, used=5)


def test_commit_hashes_only_full_computed_pages() -> None:
    kv = make_kv(4, 4)
    pool = kv.pool
    request = make_request("a", list(range(10)))
    assert kv.grow(request, 10)
    assert kv.pages_of("a") == [0, 1, 2]

    request.num_computed_tokens = 3
    kv.commit(request)
    assert_state(pool, free=1, cached=0, used=3)
    assert all(pool.lookup(x) is None for x in chain_hashes(list(range(12)), 4, "m"))

    request.num_computed_tokens = 4
    kv.commit(request)
    hashes = chain_hashes(request.token_ids, 4, "m")
    assert len(hashes) == 2
    assert [pool.lookup(x) for x in hashes] == [0, None]

    request.num_computed_tokens = 10  # page 2 holds tokens 8, 9: not full
    kv.commit(request)
    assert [pool.lookup(x) for x in hashes] == [0, 1]
    assert_state(pool, free=1, cached=0, used=3)

    request.token_ids += [10, 11]  # two generated tokens fill page 2
    request.num_computed_tokens = 11
    kv.commit(request)
    full = chain_hashes(request.token_ids, 4, "m")
    assert [pool.lookup(x) for x in full] == [0, 1, None]
    request.num_computed_tokens = 12
    kv.commit(request)
    assert [pool.lookup(x) for x in full] == [0, 1, 2]
    assert_state(pool, free=1, cached=0, used=3)

    kv.free(request)
    assert_state(pool, free=1, cached=3, used=0)
    assert kv.pages_of("a") == []


def test_commit_never_hashes_beyond_the_page_table() -> None:
    kv = make_kv(4, 2)
    request = make_request("a", list(range(6)))
    assert kv.grow(request, 2)
    request.num_computed_tokens = 6  # more than the table covers: only page 0 can be hashed
    kv.commit(request)
    assert [kv.pool.lookup(x) for x in chain_hashes(request.token_ids, 2, "m")] == [0, None, None]
    assert_state(kv.pool, free=3, cached=0, used=1)


def test_same_prefix_attaches_the_same_pages() -> None:
    kv = make_kv(8, 4)
    pool = kv.pool
    a = make_request("a", list(range(10)))
    assert kv.attach_prefix(a)[0] == 0
    assert kv.pages_of("a") == []
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=5, cached=0, used=3)

    b = make_request("b", list(range(8)) + [100, 101, 102])
    assert kv.attach_prefix(b)[0] == 8
    assert kv.pages_of("b") == [0, 1]
    assert [pool.refcount(p) for p in (0, 1, 2)] == [2, 2, 1]
    assert_state(pool, free=5, cached=0, used=3)
    assert kv.grow(b, 11)
    assert kv.pages_of("b") == [0, 1, 3]
    assert_state(pool, free=4, cached=0, used=4)
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)  # counted by the scheduler on admission

    kv.free(a)
    assert [pool.refcount(p) for p in (0, 1, 2)] == [1, 1, 0]
    assert_state(pool, free=5, cached=0, used=3)  # a's tail page 2 held 2 of 4 tokens: unhashed, free
    kv.free(b)
    assert_state(pool, free=6, cached=2, used=0)  # b's tail page 3 was never computed: free


def test_commit_after_attach_continues_the_hash_chain() -> None:
    kv = make_kv(8, 2)
    pool = kv.pool
    a = make_request("a", [1, 2, 3, 4])
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1]
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert kv.attach_prefix(b)[0] == 4
    assert kv.pages_of("b") == [0, 1]
    b.num_computed_tokens = 4
    assert kv.grow(b, 7)
    assert kv.pages_of("b") == [0, 1, 2, 3]
    b.num_computed_tokens = 7
    kv.commit(b)
    assert [pool.lookup(x) for x in chain_hashes(b.token_ids, 2, "m")] == [0, 1, 2]
    assert_state(pool, free=4, cached=0, used=4)


def test_reuse_leaves_at_least_one_token_to_compute() -> None:
    kv = make_kv(8, 4)
    pool = kv.pool
    a = make_request("a", list(range(9)))
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1, 2]
    kv.free(a)
    assert_state(pool, free=6, cached=2, used=0)  # page 2 holds one token: not hashed, went free

    same = make_request("same", list(range(9)))  # 9 tokens: 2 full pages reused, 1 token computed
    assert kv.attach_prefix(same)[0] == 8
    assert kv.pages_of("same") == [0, 1]
    assert_state(pool, free=6, cached=0, used=2)

    prefix = make_request("prefix", list(range(8)))  # an exact multiple: all but the last page reused
    assert kv.attach_prefix(prefix)[0] == 4
    assert kv.pages_of("prefix") == [0]
    assert [pool.refcount(p) for p in (0, 1)] == [2, 1]
    assert_state(pool, free=6, cached=0, used=2)

    short = make_request("short", list(range(4)))  # one full page: nothing reused
    assert kv.attach_prefix(short)[0] == 0
    assert kv.pages_of("short") == []
    single = make_request("single", [0])
    assert kv.attach_prefix(single)[0] == 0
    assert_state(pool, free=6, cached=0, used=2)


def test_exact_multiple_prompt_recomputes_its_last_page_into_a_new_page() -> None:
    kv = make_kv(4, 4)
    pool = kv.pool
    a = make_request("a", list(range(8)))
    compute_all(kv, a)
    kv.free(a)
    assert_state(pool, free=2, cached=2, used=0)
    b = make_request("b", list(range(8)))
    assert kv.attach_prefix(b)[0] == 4
    b.num_computed_tokens = 4
    assert kv.grow(b, 8)
    assert kv.pages_of("b") == [0, 2]  # a free page is taken before evicting cached page 1
    assert_state(pool, free=1, cached=1, used=2)


def test_prefix_reuse_stops_at_the_first_differing_page() -> None:
    kv = make_kv(8, 2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1, 2, 3]
    # Page 1 differs; page 2's tokens match a's, but the chained hash covers everything before it.
    b = make_request("b", [1, 2, 9, 9, 5, 6, 7])
    assert kv.attach_prefix(b)[0] == 2
    assert kv.pages_of("b") == [0]
    assert_state(kv.pool, free=4, cached=0, used=4)


def test_prefix_caching_disabled_neither_hashes_nor_reuses() -> None:
    pool = PagePool(6, page_bytes=1)
    off = KVManager(pool, 4, "m", enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    compute_all(off, a)
    assert [pool.lookup(x) for x in chain_hashes(a.token_ids, 4, "m")] == [None, None]
    off.free(a)
    assert_state(pool, free=6, cached=0, used=0)

    # Even with the pages cached by a manager that does hash, a disabled one attaches nothing.
    on = KVManager(pool, 4, "m")
    b = make_request("b", list(range(9)))
    compute_all(on, b)
    on.free(b)
    assert_state(pool, free=4, cached=2, used=0)
    c = make_request("c", list(range(9)))
    assert off.attach_prefix(c)[0] == 0
    assert off.pages_of("c") == []
    assert (off.num_prefix_queries, off.num_prefix_hits) == (0, 0)
    assert_state(pool, free=4, cached=2, used=0)


def test_prompt_logprobs_requests_do_not_reuse_but_do_share() -> None:
    kv = make_kv(8, 4)
    pool = kv.pool
    a = make_request("a", list(range(9)))
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1, 2]
    b = make_request("b", list(range(9)), prompt_logprobs=1)
    assert kv.attach_prefix(b)[0] == 0  # prompt logprobs need logits at every prompt position
    assert kv.pages_of("b") == []
    assert [pool.refcount(p) for p in (0, 1)] == [1, 1]
    assert_state(pool, free=5, cached=0, used=3)

    # Its own computed pages are still hashed for others.
    kv.free(a)
    assert_state(pool, free=6, cached=2, used=0)
    pool.reset_prefix_cache()
    assert_state(pool, free=8, cached=0, used=0)
    compute_all(kv, b)
    assert kv.pages_of("b") == [0, 1, 2]
    c = make_request("c", list(range(9)))
    assert kv.attach_prefix(c)[0] == 8
    assert kv.pages_of("c") == [0, 1]
    assert_state(pool, free=5, cached=0, used=3)


def test_free_releases_the_tail_first_so_lru_evicts_it_before_the_prefix() -> None:
    kv = make_kv(4, 4)
    pool = kv.pool
    a = make_request("a", list(range(12)))
    compute_all(kv, a)
    assert kv.pages_of("a") == [0, 1, 2]
    kv.free(a)
    assert kv.pages_of("a") == []
    assert_state(pool, free=1, cached=3, used=0)

    assert pool.allocate(2) == [3, 2]  # the free page, then the oldest cached: a's tail
    assert_state(pool, free=0, cached=2, used=2)
    hashes = chain_hashes(a.token_ids, 4, "m")
    assert [pool.lookup(x) for x in hashes] == [0, 1, None]
    assert pool.allocate(1) == [1]
    assert [pool.lookup(x) for x in hashes] == [0, None, None]
    assert_state(pool, free=0, cached=1, used=3)

    b = make_request("b", list(range(12)))
    assert kv.attach_prefix(b)[0] == 4
    assert kv.pages_of("b") == [0]
    assert_state(pool, free=0, cached=0, used=4)


def test_free_without_pages_is_a_no_op() -> None:
    kv = make_kv(2, 4)
    kv.free(make_request("a", [1, 2]))
    assert_state(kv.pool, free=2, cached=0, used=0)


def test_namespaces_do_not_share_pages() -> None:
    pool = PagePool(6, page_bytes=1)
    m = KVManager(pool, 4, "m")
    n = KVManager(pool, 4, "n")
    a = make_request("a", list(range(9)))
    compute_all(m, a)
    assert m.pages_of("a") == [0, 1, 2]
    assert_state(pool, free=3, cached=0, used=3)
    assert chain_hashes(a.token_ids, 4, "m") != chain_hashes(a.token_ids, 4, "n")

    b = make_request("b", list(range(9)))
    assert n.attach_prefix(b)[0] == 0
    assert n.pages_of("b") == []
    assert_state(pool, free=3, cached=0, used=3)
    compute_all(n, b)
    assert n.pages_of("b") == [3, 4, 5]
    assert_state(pool, free=0, cached=0, used=6)

    c = make_request("c", list(range(9)))
    assert m.attach_prefix(c)[0] == 8
    assert m.pages_of("c") == [0, 1]
    d = make_request("d", list(range(9)))
    assert n.attach_prefix(d)[0] == 8
    assert n.pages_of("d") == [3, 4]
    assert [pool.refcount(p) for p in range(6)] == [2, 2, 1, 2, 2, 1]
    assert_state(pool, free=0, cached=0, used=6)


def test_token_view_reads_like_the_list_it_windows():
    from dflash2.request import TokenView

    tokens = [10, 11, 12, 13, 14, 15]
    view = TokenView(tokens, 2, 5)
    assert list(view) == [12, 13, 14] and len(view) == 3
    assert (view[0], view[2], view[-1], view[-3]) == (12, 14, 14, 12)
    assert view[1:] == [13, 14] and view == [12, 13, 14]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            view[bad]


def test_prefix_lookup_hashes_a_waiting_prompt_once_per_length():
    pool = PagePool(8, 64)
    kv = KVManager(pool, tokens_per_page=2, namespace="m")
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    first = kv.lookup_prefix(request)
    chain = kv._lookup_chains["r"][1]
    assert kv.lookup_prefix(request) == first and kv._lookup_chains["r"][1] is chain  # not recomputed
    assert len(chain) == 2  # the full pages of all tokens but the last
    request.token_ids.append(6)
    kv.lookup_prefix(request)
    assert kv._lookup_chains["r"][0] == 6 and len(kv._lookup_chains["r"][1]) == 2
    kv.free(request)
    assert "r" not in kv._lookup_chains
