"""PagePool: bookkeeping for one device's pool of equal-sized pages (no tensors here).

Every page is in exactly one state:

    free    refcount 0, no content hash        -> handed out first by allocate()
    cached  refcount 0, content hash known     -> reusable by a prefix hit, evicted (LRU) when free runs out
    used    refcount > 0                       -> owned by one or more requests

so `num_free + num_cached + num_used == num_pages` after every operation (`check()` asserts it).
A page's bytes hold the same run of tokens whatever its state; only a hit or an allocation changes owners.
"""
from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first is evicted first
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages allocate() can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    # -- operations ------------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages (refcount 1), evicting cached ones if needed; None if too few exist."""
        if num_pages > self.num_available:
            return None
        pages = []
        for _ in range(num_pages):  # free pages first, then evicted cached ones
            page = self._free.pop() if self._free else self._evict_oldest()
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def acquire(self, page: int) -> None:
        """Add an owner to a used or cached page (a prefix hit)."""
        if self._refcount[page] == 0:
            if page not in self._cached:
                raise ValueError(f"page {page} is free; only used or cached pages can be acquired")
            del self._cached[page]
        self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one owner from each page; a page nobody owns becomes cached (if hashed) or free."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was taken")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if self._hash_of[page] is not None:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, content_hash: bytes) -> None:
        """Record that a used page holds a full run of tokens with this chained hash."""
        if self._hash_of[page] is not None or content_hash in self._page_of_hash:
            return  # already known (an equal page exists): keep the first, this one stays unhashed
        self._hash_of[page] = content_hash
        self._page_of_hash[content_hash] = page

    def lookup(self, content_hash: bytes) -> int | None:
        return self._page_of_hash.get(content_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every content hash; cached pages become free."""
        for page in list(self._cached):
            del self._cached[page]
            self._free.append(page)
        for page, content_hash in enumerate(self._hash_of):
            if content_hash is not None:
                self._hash_of[page] = None
        self._page_of_hash.clear()

    def check(self) -> None:
        """Assert the accounting invariant (tests call this after every operation)."""
        assert self.num_free + self.num_cached + self.num_used == self.num_pages
        assert sum(1 for c in self._refcount if c > 0) == self.num_used
        assert all(self._refcount[p] == 0 and self._hash_of[p] is None for p in self._free)
        assert all(self._refcount[p] == 0 and self._hash_of[p] is not None for p in self._cached)

    def _evict_oldest(self) -> int:
        page, _ = self._cached.popitem(last=False)
        content_hash = self._hash_of[page]
        self._hash_of[page] = None
        if content_hash is not None:
            del self._page_of_hash[content_hash]
        self.num_evictions += 1
        return page
