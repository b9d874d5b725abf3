"""PagePool: free / cached / used accounting, refcounts, content hashes and LRU eviction of cached pages.

Every test checks, after every operation, that free + cached + used == num_pages (and `pool.check()`).
"""
from __future__ import annotations

import pytest

from dflash2.engine.kv.page_pool import PagePool


def h(name: str) -> bytes:
    """A stand-in content hash (the pool treats hashes as opaque keys)."""
    return name.encode().ljust(16, b"\0")


def assert_state(pool: PagePool, *, free: int, cached: int, used: int) -> None:
    pool.check()
    assert pool.num_free + pool.num_cached + pool.num_used == pool.num_pages
    assert (pool.num_free, pool.num_cached, pool.num_used) == (free, cached, used)
    assert pool.num_available == free + cached


def test_pool_rejects_zero_pages() -> None:
    with pytest.raises(ValueError):
        PagePool(0, page_bytes=1)


def test_allocate_hands_out_low_ids_first() -> None:
    pool = PagePool(4, page_bytes=1)
    assert_state(pool, free=4, cached=0, used=0)
    assert pool.allocate(2) == [0, 1]
    assert_state(pool, free=2, cached=0, used=2)
    assert pool.allocate(1) == [2]
    assert_state(pool, free=1, cached=0, used=3)
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(0) == []
    assert_state(pool, free=1, cached=0, used=3)


def test_allocate_is_all_or_nothing() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(3) == [0, 1, 2]
    assert_state(pool, free=1, cached=0, used=3)
    assert pool.allocate(2) is None
    assert_state(pool, free=1, cached=0, used=3)  # nothing was taken
    assert pool.refcount(3) == 0
    assert pool.allocate(1) == [3]
    assert_state(pool, free=0, cached=0, used=4)
    assert pool.allocate(1) is None
    assert_state(pool, free=0, cached=0, used=4)


def test_released_free_pages_are_reused_most_recent_first() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.release([2, 0])
    assert_state(pool, free=2, cached=0, used=2)
    assert pool.allocate(2) == [0, 2]
    assert_state(pool, free=0, cached=0, used=4)


def test_release_unhashed_goes_free_and_hashed_goes_cached() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, h("a"))
    assert_state(pool, free=2, cached=0, used=2)  # registering does not change ownership
    assert pool.lookup(h("a")) == 0
    pool.release([0, 1])
    assert_state(pool, free=3, cached=1, used=0)
    assert pool.refcount(0) == 0 and pool.refcount(1) == 0
    assert pool.lookup(h("a")) == 0  # a cached page keeps its content hash


def test_acquire_cached_page_moves_it_to_used() -> None:
    pool = PagePool(3, page_bytes=1)
    assert pool.allocate(1) == [0]
    pool.register(0, h("a"))
    pool.release([0])
    assert_state(pool, free=2, cached=1, used=0)
    pool.acquire(0)
    assert_state(pool, free=2, cached=0, used=1)
    assert pool.refcount(0) == 1
    pool.acquire(0)  # a second owner of a used page
    assert_state(pool, free=2, cached=0, used=1)
    assert pool.refcount(0) == 2
    pool.release([0])
    assert_state(pool, free=2, cached=0, used=1)
    assert pool.refcount(0) == 1
    pool.release([0])
    assert_state(pool, free=2, cached=1, used=0)
    assert pool.lookup(h("a")) == 0


def test_acquire_free_page_raises() -> None:
    pool = PagePool(2, page_bytes=1)
    with pytest.raises(ValueError):
        pool.acquire(1)
    assert_state(pool, free=2, cached=0, used=0)
    assert pool.refcount(1) == 0


def test_allocate_takes_free_pages_before_evicting_cached_ones() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, h("a"))
    pool.release([0, 1])
    assert_state(pool, free=3, cached=1, used=0)
    assert pool.allocate(3) == [1, 2, 3]
    assert_state(pool, free=0, cached=1, used=3)
    assert pool.num_evictions == 0
    assert pool.lookup(h("a")) == 0
    assert pool.allocate(1) == [0]
    assert_state(pool, free=0, cached=0, used=4)
    assert pool.num_evictions == 1
    assert pool.lookup(h("a")) is None


def test_lru_evicts_oldest_cached_first_and_forgets_its_hash() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for page in range(4):
        pool.register(page, h(f"p{page}"))
    for page in (2, 0, 3, 1):  # cached in this order: 2 is the oldest
        pool.release([page])
    assert_state(pool, free=0, cached=4, used=0)

    assert pool.allocate(1) == [2]
    assert_state(pool, free=0, cached=3, used=1)
    assert pool.lookup(h("p2")) is None
    assert [pool.lookup(h(f"p{p}")) for p in (0, 3, 1)] == [0, 3, 1]

    assert pool.allocate(2) == [0, 3]
    assert_state(pool, free=0, cached=1, used=3)
    assert pool.lookup(h("p0")) is None and pool.lookup(h("p3")) is None
    assert pool.lookup(h("p1")) == 1
    assert pool.num_evictions == 3

    # An evicted page comes back unhashed: releasing it makes it free, not cached.
    pool.release([2])
    assert_state(pool, free=1, cached=1, used=2)


def test_acquire_then_release_makes_a_cached_page_most_recent() -> None:
    pool = PagePool(2, page_bytes=1)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, h("a"))
    pool.register(1, h("b"))
    pool.release([0, 1])  # LRU order: 0, 1
    assert_state(pool, free=0, cached=2, used=0)
    pool.acquire(0)
    assert_state(pool, free=0, cached=1, used=1)
    pool.release([0])  # LRU order now: 1, 0
    assert_state(pool, free=0, cached=2, used=0)
    assert pool.allocate(1) == [1]
    assert_state(pool, free=0, cached=1, used=1)
    assert pool.lookup(h("b")) is None
    assert pool.lookup(h("a")) == 0


def test_failed_allocate_does_not_evict() -> None:
    pool = PagePool(3, page_bytes=1)
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(0, h("a"))
    pool.register(1, h("b"))
    pool.release([0, 1])
    assert_state(pool, free=0, cached=2, used=1)
    assert pool.allocate(3) is None
    assert_state(pool, free=0, cached=2, used=1)
    assert pool.num_evictions == 0
    assert (pool.lookup(h("a")), pool.lookup(h("b"))) == (0, 1)


def test_double_release_raises() -> None:
    pool = PagePool(2, page_bytes=1)
    assert pool.allocate(1) == [0]
    pool.release([0])
    assert_state(pool, free=2, cached=0, used=0)
    with pytest.raises(ValueError):
        pool.release([0])
    assert_state(pool, free=2, cached=0, used=0)
    with pytest.raises(ValueError):
        pool.release([1])  # never allocated
    assert_state(pool, free=2, cached=0, used=0)


def test_double_release_of_a_cached_page_raises() -> None:
    pool = PagePool(2, page_bytes=1)
    assert pool.allocate(1) == [0]
    pool.register(0, h("a"))
    pool.release([0])
    assert_state(pool, free=1, cached=1, used=0)
    with pytest.raises(ValueError):
        pool.release([0])
    assert_state(pool, free=1, cached=1, used=0)
    assert pool.lookup(h("a")) == 0


def test_register_duplicate_hash_keeps_the_first_page() -> None:
    pool = PagePool(3, page_bytes=1)
    assert pool.allocate(2) == [0, 1]
    pool.register(0, h("a"))
    pool.register(1, h("a"))  # an equal page computed twice: the second stays unhashed
    assert_state(pool, free=1, cached=0, used=2)
    assert pool.lookup(h("a")) == 0
    pool.register(0, h("b"))  # a hashed page keeps its first hash
    assert pool.lookup(h("b")) is None
    assert pool.lookup(h("a")) == 0
    pool.release([0, 1])
    assert_state(pool, free=2, cached=1, used=0)  # page 1 went free, page 0 cached
    assert pool.allocate(2) == [1, 2]
    assert_state(pool, free=0, cached=1, used=2)
    assert pool.lookup(h("a")) == 0


def test_reset_prefix_cache_frees_cached_pages_and_forgets_all_hashes() -> None:
    pool = PagePool(4, page_bytes=1)
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(0, h("a"))
    pool.register(1, h("b"))
    pool.release([0])
    assert_state(pool, free=1, cached=1, used=2)

    pool.reset_prefix_cache()
    assert_state(pool, free=2, cached=0, used=2)
    assert pool.lookup(h("a")) is None and pool.lookup(h("b")) is None
    assert [pool.refcount(p) for p in range(4)] == [0, 1, 1, 0]

    pool.release([1])  # its hash was forgotten while in use: it goes free, not cached
    assert_state(pool, free=3, cached=0, used=1)
    assert pool.allocate(3) == [1, 0, 3]
    assert_state(pool, free=0, cached=0, used=4)
    assert pool.num_evictions == 0

    pool.register(0, h("a"))  # a hash forgotten by the reset can be registered again
    assert pool.lookup(h("a")) == 0


# -- several models on one pool ------------------------------------------------------------------------------
def test_pages_are_counted_per_model_and_a_leaving_model_frees_its_cached_pages() -> None:
    pool = PagePool(6, page_bytes=1)
    a, b = pool.allocate(2, "a"), pool.allocate(3, "b")
    pool.register(a[0], b"a0")
    pool.register(b[0], b"b0")
    pool.release(a + b[:1])
    pool.check()
    assert (pool.num_used_by("a"), pool.num_cached_by("a"), pool.num_used_by("b"), pool.num_cached_by("b")) == (0, 1, 2, 1)
    pool.acquire(b[0])  # a prefix hit of b's
    assert (pool.num_used_by("b"), pool.num_cached_by("b")) == (3, 0)
    with pytest.raises(ValueError, match="'b' still uses 3 pages"):
        pool.forget("b")
    pool.forget("a")
    pool.check()
    assert pool.num_cached == 0 and pool.num_free == 3 and pool.lookup(b"a0") is None and pool.lookup(b"b0") == b[0]


def test_a_floor_keeps_pages_for_its_model_and_a_ceiling_caps_one() -> None:
    pool = PagePool(10, page_bytes=1)
    pool.set_limits("cold", floor=3)
    pool.set_limits("capped", ceiling=4)
    assert pool.available_for("hot") == 7 and pool.available_for("cold") == 10 and pool.available_for("capped") == 4
    assert pool.allocate(8, "hot") is None  # would eat into cold's floor
    hot = pool.allocate(5, "hot")
    assert pool.available_for("capped") == 2 and pool.allocate(3, "capped") is None
    capped = pool.allocate(2, "capped")
    assert pool.available_for("cold") == 3 and pool.available_for("hot") == 0
    cold = pool.allocate(1, "cold")
    assert pool.available_for("hot") == 0 and pool.available_for("cold") == 2  # its floor: 2 more stay its
    pool.release(hot)
    assert pool.available_for("capped") == 2 and pool.available_for("hot") == 5  # capped holds 2 of its 4
    pool.release(capped + cold)
    pool.check()
    with pytest.raises(ValueError, match="minimum pool shares add up to 11 pages"):
        pool.set_limits("greedy", floor=8)
    with pytest.raises(ValueError, match="floor 2 and ceiling 1 pages do not make sense"):
        pool.set_limits("odd", floor=2, ceiling=1)
