"""HostPagePool: bookkeeping for the pinned host pages (the L2 tier): swapped-out requests' KV, and pages
evicted from the device's prefix cache.

Every host page is in exactly one state: `num_free + num_swapped + num_cached == num_pages`.

    free     -> handed out first
    swapped  a paused request's page (allocate / release): always wins a page over a cached one
    cached   a page the device's prefix cache evicted (store), by its content hash; LRU: evicted (forgotten) when
             a swap or a newer cached page needs room; taken back up to the device on a prefix hit (take)

Host pages are the same size in bytes as device pages (PoolStorage holds the bytes), so a copy is one
page-sized block either way.

Free pages are kept as runs of consecutive ids, and a request's pages come from the first run long enough
(else from the lowest runs): the runner copies each run of consecutive host pages with one call, and under
W3 a swap of ~40 pages had come to ~10 runs from a last-in-first-out free list (~25 us of host time a run).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict


class HostPagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._starts: list[int] = [0] if num_pages else []  # free runs, sorted: first page ids ...
        self._lengths: list[int] = [num_pages] if num_pages else []  # ... and their lengths
        self._num_free = num_pages
        self._taken = [False] * num_pages  # not free: swapped or cached
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._owner: list[str | None] = [None] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first is evicted first
        self.num_evictions = 0  # cached pages dropped for room

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_swapped(self) -> int:
        return self.num_pages - self._num_free - len(self._cached)

    # -- the cached (L2) pages ------------------------------------------------------------------------
    def lookup(self, content_hash: bytes) -> int | None:
        return self._page_of_hash.get(content_hash)

    def store(self, evicted: list[tuple[bytes, str | None]]) -> list[int | None]:
        """Host pages for pages the device evicts, (hash, owner) each (the caller copies their bytes), cached by
        their hashes; None for one that is here already or when every host page holds swapped KV. Taken in one
        allocation, so they come in few runs of consecutive pages (one copy per run)."""
        new = []
        for content_hash, owner in evicted:
            page = self._page_of_hash.get(content_hash)
            if page is not None:
                self._cached.move_to_end(page)
            elif content_hash not in (h for h, _ in new):
                new.append((content_hash, owner))
        count = min(len(new), self._num_free + len(self._cached))
        pages = self.allocate(count) if count else []
        stored: dict[bytes, int] = {}
        for page, (content_hash, owner) in zip(pages, new):
            self._hash_of[page], self._owner[page] = content_hash, owner
            self._page_of_hash[content_hash] = page
            self._cached[page] = None
            stored[content_hash] = page
        return [stored.get(content_hash) for content_hash, _ in evicted]

    def take(self, page: int) -> None:
        """A cached page goes up to the device (a prefix hit): it is free here from now on (the copy reads it
        before any later write: the swap copies are in order)."""
        del self._cached[page]
        self._forget_hash(page)
        self.release([page])

    def forget(self, owner: str) -> None:
        """A model leaves: its cached pages become free."""
        for page in [p for p in self._cached if self._owner[p] == owner]:
            self.take(page)

    def _forget_hash(self, page: int) -> None:
        del self._page_of_hash[self._hash_of[page]]
        self._hash_of[page] = self._owner[page] = None

    def _evict_oldest(self) -> None:
        page, _ = self._cached.popitem(last=False)
        self._forget_hash(page)
        self.release([page])
        self.num_evictions += 1

    # -- swapped pages --------------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int] | None:
        """Pages for a swap (or one cached page): free ones, then the least recently cached ones evicted."""
        if num_pages > self._num_free + len(self._cached):
            return None
        while num_pages > self._num_free:
            self._evict_oldest()
        pages: list[int] = []
        fits = next((i for i, length in enumerate(self._lengths) if length >= num_pages), None)
        while len(pages) < num_pages:
            index = fits if fits is not None else 0
            start, length = self._starts[index], self._lengths[index]
            take = min(length, num_pages - len(pages))
            pages.extend(range(start, start + take))
            if take == length:
                del self._starts[index], self._lengths[index]
            else:
                self._starts[index], self._lengths[index] = start + take, length - take
        for page in pages:
            self._taken[page] = True
        self._num_free -= num_pages
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if not self._taken[page]:
                raise ValueError(f"host page {page} released but not taken")
            self._taken[page] = False
        self._num_free += len(pages)
        for page in sorted(pages):
            self._free_one(page)

    def _free_one(self, page: int) -> None:
        """Put one page back in its run, joining the runs on either side of it."""
        index = bisect.bisect(self._starts, page)
        joins_left = index > 0 and self._starts[index - 1] + self._lengths[index - 1] == page
        joins_right = index < len(self._starts) and self._starts[index] == page + 1
        if joins_left and joins_right:
            self._lengths[index - 1] += 1 + self._lengths[index]
            del self._starts[index], self._lengths[index]
        elif joins_left:
            self._lengths[index - 1] += 1
        elif joins_right:
            self._starts[index] = page
            self._lengths[index] += 1
        else:
            self._starts.insert(index, page)
            self._lengths.insert(index, 1)

    def check(self) -> None:
        """Every page is free, swapped or cached, exactly one; the free runs are sorted, apart and hold each free
        page once; a cached page has its hash."""
        free = [page for start, length in zip(self._starts, self._lengths) for page in range(start, start + length)]
        assert free == sorted(set(free)) and not any(self._taken[page] for page in free)
        assert all(self._starts[i] + self._lengths[i] < self._starts[i + 1] for i in range(len(self._starts) - 1))
        assert len(free) == self._num_free and sum(self._taken) == self.num_swapped + self.num_cached
        assert all(self._taken[p] and self._page_of_hash[self._hash_of[p]] == p for p in self._cached)
        assert len(self._page_of_hash) == len(self._cached)
