"""PagePool: bookkeeping for one device's pool of equal-sized pages (no tensors here).

Every page is in exactly one state:

    free    refcount 0, no content hash        -> handed out first by allocate()
    cached  refcount 0, content hash known     -> reusable by a prefix hit, evicted (LRU) when free runs out
    used    refcount > 0                       -> owned by one or more requests

so `num_free + num_cached + num_used == num_pages` after every operation (`check()` asserts it).
A page's bytes hold the same run of tokens whatever its state; only a hit or an allocation changes owners.

Several models share one pool (DESIGN.md decision 1): each allocates under its own name (`owner`), and a used
or cached page remembers whose it is, so the pool counts each model's pages (`num_used_by`, `num_cached_by`).
A model may have a floor (pages the others cannot take while it holds fewer) and a ceiling (pages it may hold
at most): `set_limits`; `available_for(owner)` is what allocate() can give that model now. Eviction of cached
pages is one LRU across all models.
"""
from __future__ import annotations

from collections import Counter, OrderedDict


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
        self._owner: list[str | None] = [None] * num_pages  # the model a used or cached page belongs to
        self._used_by: Counter[str | None] = Counter()
        self._cached_by: Counter[str | None] = Counter()
        self._limits: dict[str, tuple[int, int | None]] = {}  # owner -> (floor, ceiling) in pages
        self.num_evictions = 0
        # with a host tier: evicted cached pages, (page, hash, owner), for the scheduler to copy down (take_evicted)
        self.keep_evicted = False
        self._evicted: list[tuple[int, bytes, str | None]] = []

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

    def num_used_by(self, owner: str | None) -> int:
        return self._used_by[owner]

    def num_cached_by(self, owner: str | None) -> int:
        return self._cached_by[owner]

    # -- sharing between models -------------------------------------------------------------------
    def set_limits(self, owner: str, floor: int = 0, ceiling: int | None = None) -> None:
        """`owner` keeps at least `floor` pages within reach (the other models cannot allocate into them while it
        uses fewer) and uses at most `ceiling` pages (None: no limit)."""
        if floor < 0 or (ceiling is not None and ceiling < max(1, floor)):
            raise ValueError(f"pool limits of {owner!r}: floor {floor} and ceiling {ceiling} pages do not make sense")
        reserved = floor + sum(f for o, (f, _) in self._limits.items() if o != owner)
        if reserved > self.num_pages:
            raise ValueError(f"the models' minimum pool shares add up to {reserved} pages, more than the pool's "
                             f"{self.num_pages}")
        if floor == 0 and ceiling is None:
            self._limits.pop(owner, None)  # no limits: nothing for available_for to look at
        else:
            self._limits[owner] = (floor, ceiling)

    def available_for(self, owner: str | None) -> int:
        """Pages allocate(n, owner) can hand out now: free and evictable cached pages, less the other models'
        unused floors, and no more than `owner`'s ceiling allows."""
        available = self.num_available
        if not self._limits:  # no model has a floor or a ceiling (a single model, as a rule)
            return available
        for other, (floor, _) in self._limits.items():
            if other != owner and floor > self._used_by[other]:
                available -= floor - self._used_by[other]
        limits = self._limits.get(owner) if owner is not None else None
        if limits is not None and limits[1] is not None:
            available = min(available, limits[1] - self._used_by[owner])
        return max(0, available)

    def forget(self, owner: str) -> None:
        """A model leaves the pool: its cached pages become free and its limits go (it must hold none in use)."""
        if self._used_by[owner]:
            raise ValueError(f"{owner!r} still uses {self._used_by[owner]} pages")
        for page in [p for p in self._cached if self._owner[p] == owner]:
            del self._cached[page]
            self._unhash(page)
            self._free.append(page)
        self._cached_by.pop(owner, None)
        self._used_by.pop(owner, None)
        self._limits.pop(owner, None)

    # -- operations ------------------------------------------------------------------------------
    def allocate(self, num_pages: int, owner: str | None = None) -> list[int] | None:
        """Take `num_pages` pages (refcount 1) for `owner`, evicting cached ones if needed; None if too few are
        available to it."""
        if num_pages > self.available_for(owner):
            return None
        pages = []
        for _ in range(num_pages):  # free pages first, then evicted cached ones
            page = self._free.pop() if self._free else self._evict_oldest()
            self._refcount[page] = 1
            self._owner[page] = owner
            pages.append(page)
        self._used_by[owner] += num_pages
        return pages

    def acquire(self, page: int) -> None:
        """Add an owner to a used or cached page (a prefix hit)."""
        if self._refcount[page] == 0:
            if page not in self._cached:
                raise ValueError(f"page {page} is free; only used or cached pages can be acquired")
            del self._cached[page]
            self._cached_by[self._owner[page]] -= 1
            self._used_by[self._owner[page]] += 1
        self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one owner from each page; a page nobody owns becomes cached (if hashed) or free."""
        for page in pages:
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was taken")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                owner = self._owner[page]
                self._used_by[owner] -= 1
                if self._hash_of[page] is not None:
                    self._cached[page] = None
                    self._cached_by[owner] += 1
                else:
                    self._owner[page] = None
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
            self._owner[page] = None
            self._free.append(page)
        self._cached_by.clear()
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
        assert sum(self._used_by.values()) == self.num_used and sum(self._cached_by.values()) == self.num_cached
        assert all(self._owner[p] is None for p in self._free)

    def evict(self, num_pages: int) -> list[tuple[int, bytes, str | None]]:
        """Evict up to `num_pages` of the least recently used cached pages now (they become free), ahead of need:
        (page, hash, owner) each, their bytes intact until a later step writes them."""
        evicted = []
        for _ in range(min(num_pages, len(self._cached))):
            oldest = next(iter(self._cached))
            evicted.append((oldest, self._hash_of[oldest], self._owner[oldest]))
            self._free.append(self._evict_oldest(keep=False))
        return evicted

    def cached_pages(self) -> list[tuple[str, int, bytes, str | None]]:
        """("device", page, hash, owner) of every cached page, least recently used first."""
        return [("device", page, self._hash_of[page], self._owner[page]) for page in self._cached]

    def take_evicted(self) -> list[tuple[int, bytes, str | None]]:
        """The cached pages evicted since the last call (keep_evicted): their bytes are still there until the
        step that reuses them runs, so the caller can copy them down first."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict_oldest(self, keep: bool = True) -> int:
        page, _ = self._cached.popitem(last=False)
        self._cached_by[self._owner[page]] -= 1
        if keep and self.keep_evicted:
            self._evicted.append((page, self._hash_of[page], self._owner[page]))
        self._unhash(page)
        self.num_evictions += 1
        return page

    def _unhash(self, page: int) -> None:
        content_hash = self._hash_of[page]
        self._hash_of[page] = None
        self._owner[page] = None
        if content_hash is not None:
            del self._page_of_hash[content_hash]
