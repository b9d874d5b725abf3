"""HostPagePool: bookkeeping for the pinned host pages that swapped-out requests' KV lives in.

Every host page is free or holds one swapped request's page: `num_free + num_swapped == num_pages`.
Host pages are the same size in bytes as device pages (the runner holds the bytes), so a copy is one
page-sized block either way.

Free pages are kept as runs of consecutive ids, and a request's pages come from the first run long enough
(else from the lowest runs): the runner copies each run of consecutive host pages with one call, and under
W3 a swap of ~40 pages had come to ~10 runs from a last-in-first-out free list (~25 us of host time a run).
"""
from __future__ import annotations

import bisect


class HostPagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._starts: list[int] = [0] if num_pages else []  # free runs, sorted: first page ids ...
        self._lengths: list[int] = [num_pages] if num_pages else []  # ... and their lengths
        self._num_free = num_pages
        self._taken = [False] * num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_swapped(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, num_pages: int) -> list[int] | None:
        if num_pages > self._num_free:
            return None
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
        """Every page is free or taken, never both; the free runs are sorted, apart and hold each free page
        once."""
        free = [page for start, length in zip(self._starts, self._lengths) for page in range(start, start + length)]
        assert free == sorted(set(free)) and not any(self._taken[page] for page in free)
        assert all(self._starts[i] + self._lengths[i] < self._starts[i + 1] for i in range(len(self._starts) - 1))
        assert len(free) == self._num_free and sum(self._taken) == self.num_swapped
