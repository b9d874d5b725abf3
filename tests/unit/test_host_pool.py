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
