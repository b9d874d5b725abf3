"""HostPagePool: bookkeeping for the pinned host pages (the L2 tier): swapped-out requests' KV, and pages of the
device's prefix cache copied down.

Every host page is in exactly one state: `num_free + num_swapped + num_cached + num_loading == num_pages`.

    free     -> handed out first
    swapped  a paused request's page (allocate / release): always wins a page over a cached one. A paused
             request spilled to disk (L3) turns its full pages into cached ones (keep), written down first
    cached   a full page of the prefix cache, by its content hash (store); evicted (forgotten) in ring order when
             a swap or a newer page needs room. A prefix hit copies it up and keeps it (touch): the tier is
             inclusive, so a page evicted from the device again costs no copy. A cached page being written to disk
             (L3) is pinned: never evicted until the write is done
    loading  a page being read from disk (L3) into host memory (reserve), cached when the read is in (fill)

Host pages are the same size in bytes as device pages (PoolStorage holds the bytes), so a copy is one
page-sized block either way.

Free pages are kept as runs of consecutive ids, and a request's pages come from the first run long enough
(else from the lowest runs): the runner copies each run of consecutive host pages with one call, and under
W3 a swap of ~40 pages had come to ~10 runs from a last-in-first-out free list (~25 us of host time a run).

Room for cached pages is made in ring order: a cursor walks the pages, taking free ones and evicting the cached
ones it meets (skipping swapped, loading and pinned ones), so the pages of one store are consecutive (one copy)
and the oldest cached pages are the ones just ahead of the cursor. With a disk tier the cached pages are written
down in ring order from the cursor on (pages_ahead: the next to leave first), as fast as the writers take them, so
a page leaving host memory is on disk already: each page is written at most once, not every time it comes down.
(An LRU over host pages had scattered each batch over many runs: ~0.5 ms of copy calls a swap, W3 on the H100.)
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
        self._taken = [False] * num_pages  # not free: swapped, cached or loading
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._owner: list[str | None] = [None] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first is evicted first
        self._pinned: set[int] = set()  # cached pages being written to disk
        self._loading: set[int] = set()
        self._on_disk = [False] * num_pages  # a cached page known to be in the disk tier too
        self._position = 0  # pages the cursor has passed, in all (the cursor: _position % num_pages)
        self._scanned = 0  # ring positions pages_ahead has looked at, up to here
        self.num_evictions = 0  # cached pages dropped for room
        self.num_stored = 0  # pages cached by store (copied down from the device)
        self.num_touched = 0  # cached pages copied up by a prefix hit

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_swapped(self) -> int:
        return self.num_pages - self._num_free - len(self._cached) - len(self._loading)

    @property
    def num_evictable(self) -> int:
        return len(self._cached) - len(self._pinned)

    # -- the cached (L2) pages ------------------------------------------------------------------------
    def lookup(self, content_hash: bytes) -> int | None:
        return self._page_of_hash.get(content_hash)

    def owner_of(self, page: int) -> str | None:
        return self._owner[page]

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of[page]

    def store(self, pages: list[tuple[bytes, str | None]]) -> list[int | None]:
        """Host pages for device pages going down, (hash, owner) each (the caller copies their bytes), cached by
        their hashes; None for one that is here already (made most recent: no copy needed) or when no host page
        is free or evictable. Taken in one allocation, so they come in few runs of consecutive pages."""
        new: dict[bytes, str | None] = {}
        for content_hash, owner in pages:
            page = self._page_of_hash.get(content_hash)
            if page is not None:
                self._cached.move_to_end(page)
            else:
                new.setdefault(content_hash, owner)
        taken = self._take_at_cursor(min(len(new), self._num_free + self.num_evictable))
        stored: dict[bytes, int] = {}
        for page, (content_hash, owner) in zip(taken, new.items()):
            self._cache(page, content_hash, owner)
            stored[content_hash] = page
        self.num_stored += len(taken)
        return [stored.pop(content_hash, None) for content_hash, _ in pages]

    def cached_pages(self) -> list[tuple[str, int, bytes, str | None]]:
        """("host", page, hash, owner) of every cached page, least recently used first."""
        return [("host", page, self._hash_of[page], self._owner[page]) for page in self._cached]

    def _take_at_cursor(self, count: int) -> list[int]:
        """`count` pages from the cursor on: free ones taken, cached ones evicted and taken (one lap at most)."""
        pages: list[int] = []
        for _ in range(self.num_pages if count else 0):
            page = self._position % self.num_pages
            self._position += 1
            if page in self._cached and page not in self._pinned:
                self._drop(page)
                self.num_evictions += 1
            if not self._taken[page]:
                self._take_free(page)
                pages.append(page)
                if len(pages) == count:
                    break
        return pages

    def _take_free(self, page: int) -> None:
        """Take one given free page out of its run."""
        index = bisect.bisect(self._starts, page) - 1
        start, length = self._starts[index], self._lengths[index]
        del self._starts[index], self._lengths[index]
        if page + 1 < start + length:
            self._starts.insert(index, page + 1)
            self._lengths.insert(index, start + length - page - 1)
        if page > start:
            self._starts.insert(index, start)
            self._lengths.insert(index, page - start)
        self._taken[page] = True
        self._num_free -= 1

    def pages_ahead(self, window: int, limit: int | None = None) -> list[tuple[int, bytes, str | None]]:
        """(page, hash, owner) of the cached pages within `window` ring positions ahead of the cursor that are
        neither pinned nor known to be on disk, in ring order (the next to leave first), each reported once per
        lap; at most `limit` of them: the scan stops after the last one reported, so the pages past it are
        reported by a later call (if the cursor has not passed them by then)."""
        end = self._position + min(window, self.num_pages)
        found = []
        position = max(self._scanned, self._position)
        while position < end and (limit is None or len(found) < limit):
            page = position % self.num_pages
            position += 1
            if page in self._cached and page not in self._pinned and not self._on_disk[page]:
                found.append((page, self._hash_of[page], self._owner[page]))
        self._scanned = max(self._scanned, position)
        return found

    def mark_on_disk(self, page: int) -> None:
        if page in self._cached:
            self._on_disk[page] = True

    def keep(self, page: int, content_hash: bytes, owner: str | None) -> bool:
        """A swapped page becomes a cached one under its content hash, pinned (a paused request spilled to disk:
        its pages stay here until written); False, and the page freed, when that hash is cached here already."""
        if content_hash in self._page_of_hash:
            self.release([page])
            return False
        self._cache(page, content_hash, owner)
        self._pinned.add(page)
        return True

    def touch(self, page: int) -> None:
        """A prefix hit copied the page up: it stays here too, as the most recently used."""
        self._cached.move_to_end(page)
        self.num_touched += 1

    def pin(self, page: int) -> None:
        self._pinned.add(page)

    def unpin(self, page: int) -> None:
        self._pinned.discard(page)

    def reserve(self, num_pages: int) -> list[int] | None:
        """Pages to read disk pages into (loading until fill or release)."""
        pages = self.allocate(num_pages)
        if pages is not None:
            self._loading.update(pages)
        return pages

    def fill(self, page: int, content_hash: bytes, owner: str | None) -> None:
        """A loading page's read is in: it is cached under its hash (freed if that hash is here already)."""
        self._loading.remove(page)
        if content_hash in self._page_of_hash:
            self.release([page])
        else:
            self._cache(page, content_hash, owner)
            self._on_disk[page] = True

    def unload(self, page: int) -> None:
        """A loading page's read failed: free again."""
        self._loading.remove(page)
        self.release([page])

    def forget(self, owner: str) -> None:
        """A model leaves: its cached pages become free (a pinned one when its write is done: unpin)."""
        for page in [p for p in self._cached if self._owner[p] == owner and p not in self._pinned]:
            self._drop(page)

    def _cache(self, page: int, content_hash: bytes, owner: str | None) -> None:
        self._hash_of[page], self._owner[page] = content_hash, owner
        self._page_of_hash[content_hash] = page
        self._cached[page] = None

    def _drop(self, page: int) -> None:
        del self._cached[page]
        del self._page_of_hash[self._hash_of[page]]
        self._hash_of[page] = self._owner[page] = None
        self._on_disk[page] = False
        self.release([page])

    def _evict(self, count: int) -> None:
        """Drop `count` cached pages that are not pinned, in ring order from the cursor (the oldest first, and
        next to each other: the room they leave comes in few runs)."""
        evicted = 0
        for _ in range(self.num_pages):
            if evicted == count:
                break
            page = self._position % self.num_pages
            self._position += 1
            if page in self._cached and page not in self._pinned:
                self._drop(page)
                evicted += 1
        self.num_evictions += evicted

    # -- swapped pages --------------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int] | None:
        """Pages for a swap (or for reading from disk): free ones, then cached ones evicted from the cursor on."""
        if num_pages > self._num_free + self.num_evictable:
            return None
        if num_pages > self._num_free:
            self._evict(num_pages - self._num_free)
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
        """Every page is free, swapped, cached or loading, exactly one; the free runs are sorted, apart and hold
        each free page once; a cached page has its hash; only cached pages are pinned."""
        free = [page for start, length in zip(self._starts, self._lengths) for page in range(start, start + length)]
        assert free == sorted(set(free)) and not any(self._taken[page] for page in free)
        assert all(self._starts[i] + self._lengths[i] < self._starts[i + 1] for i in range(len(self._starts) - 1))
        assert len(free) == self._num_free
        assert sum(self._taken) == self.num_swapped + self.num_cached + self.num_loading
        assert self._pinned <= set(self._cached) and not self._loading & set(self._cached)
        assert all(self._taken[p] for p in self._loading)
        assert all(p in self._cached for p, on in enumerate(self._on_disk) if on)
        assert all(self._taken[p] and self._page_of_hash[self._hash_of[p]] == p for p in self._cached)
        assert len(self._page_of_hash) == len(self._cached)
