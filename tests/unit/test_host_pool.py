"""HostPagePool hands out runs of consecutive host pages (one copy call each in the runner)."""
from __future__ import annotations

import random

import pytest

from dflash2.engine.kv.host_pool import HostPagePool


def test_pages_come_from_the_first_run_long_enough_and_released_runs_join_again():
    pool = HostPagePool(16)
    a, b, c = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    assert (a, b, c) == ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    pool.release(list(reversed(a)))  # free: 0-3, 12-15
    assert pool.allocate(3) == [0, 1, 2]  # the first run long enough, from its start
    assert pool.allocate(2) == [12, 13]  # 3 alone is too short: the next run that fits
    pool.release(b)  # 4-7 join the free page 3: free 3-7, 14-15
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.allocate(3) is None and pool.num_free == 2
    pool.release(c)  # free: 8-11, 14-15
    assert pool.allocate(6) == [8, 9, 10, 11, 14, 15]  # no run long enough: the lowest runs in turn
    assert pool.num_free == 0 and pool.num_swapped == 16
    pool.check()


def test_a_page_released_twice_or_never_taken_is_an_error():
    pool = HostPagePool(4)
    pages = pool.allocate(2)
    pool.release(pages)
    with pytest.raises(ValueError, match="host page 0"):
        pool.release([0])
    with pytest.raises(ValueError, match="host page 3"):
        pool.release([3])


def test_random_churn_keeps_the_books_and_every_page_once():
    rng = random.Random(0)
    pool = HostPagePool(200)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or pool.num_free < 20):
            pool.release(held.pop(rng.randrange(len(held))))
        else:
            pages = pool.allocate(rng.randrange(1, 20))
            if pages is not None:
                held.append(pages)
        pool.check()
        taken = [p for pages in held for p in pages]
        assert len(taken) == len(set(taken)) == pool.num_swapped
    for pages in held:
        pool.release(pages)
    assert pool.allocate(200) == list(range(200))  # everything back in one run


def test_cached_pages_are_taken_and_evicted_in_ring_order():
    """A store's pages are consecutive; once the pool is full, the oldest cached pages (just ahead of the cursor)
    make room, next to each other, skipping swapped and pinned pages; pages_ahead names the next to leave."""
    pool = HostPagePool(8)
    assert pool.store([(b"a", "m"), (b"b", "m"), (b"c", "m")]) == [0, 1, 2]
    swapped = pool.allocate(2)  # a paused request's pages: first fit among the free runs
    assert swapped == [3, 4]
    assert pool.store([(b"d", "m"), (b"b", "m")]) == [5, None]  # b is here already: no copy
    assert pool.pages_ahead(4) == [(0, b"a", "m"), (1, b"b", "m")]  # the cursor is at 6: 6 and 7 are free
    pool.pin(1)  # being written to disk
    assert pool.store([(b"e", "m"), (b"f", "m"), (b"g", "m")]) == [6, 7, 0]  # 0 (a, the oldest) evicted
    assert pool.lookup(b"a") is None and pool.lookup(b"b") == 1 and pool.num_evictions == 1
    assert pool.pages_ahead(3) == [(2, b"c", "m")]  # 1 pinned, 3 and 4 swapped
    assert pool.pages_ahead(3) == []  # each page once per lap
    assert pool.store([(b"h", "m")]) == [2]  # past the pinned page: c goes
    assert pool.num_evictions == 2
    pool.unpin(1)
    pool.mark_on_disk(5)
    pool.release(swapped)
    pool.check()
    assert (pool.num_free, pool.num_cached, pool.num_swapped) == (2, 6, 0)


def test_a_spilled_request_keeps_its_pages_as_cached_ones_pinned_until_written():
    """keep: a swapped page becomes a cached page under its hash, pinned (not evicted until its write is in); a
    hash cached here already frees the page instead."""
    pool = HostPagePool(4)
    assert pool.store([(b"a", "m")]) == [0]
    swapped = pool.allocate(3)
    assert swapped == [1, 2, 3]
    assert [pool.keep(page, h, "m") for page, h in zip(swapped[:2], (b"x", b"a"))] == [True, False]
    assert pool.lookup(b"x") == 1 and pool.lookup(b"a") == 0 and pool.hash_of(1) == b"x"
    assert (pool.num_free, pool.num_cached, pool.num_swapped, pool.num_evictable) == (1, 2, 1, 1)
    assert pool.allocate(2) == [0, 2]  # the free page and a (evicted); x is pinned
    assert pool.lookup(b"x") == 1 and pool.allocate(1) is None
    pool.unpin(1)  # written
    assert pool.allocate(1) == [1] and pool.lookup(b"x") is None
    pool.check()


def test_pages_ahead_with_a_limit_resumes_where_it_stopped():
    """A write queue with room for two pages takes the next two to leave; the pages past them are named by the
    next call, not skipped for the lap."""
    pool = HostPagePool(6)
    pool.store([(bytes([i]), "m") for i in range(6)])  # the cursor is back at 0: page 0 leaves first
    assert pool.pages_ahead(6, limit=2) == [(0, b"\x00", "m"), (1, b"\x01", "m")]
    assert pool.pages_ahead(6, limit=0) == []
    assert pool.pages_ahead(6, limit=3) == [(2, b"\x02", "m"), (3, b"\x03", "m"), (4, b"\x04", "m")]
    pool.store([(b"new", "m")])  # takes page 0 (its old page evicted): page 5 leaves next, then the new page
    assert pool.pages_ahead(6) == [(5, b"\x05", "m"), (0, b"new", "m")]
    assert pool.pages_ahead(6) == []
    pool.check()
