"""HostPagePool: bookkeeping for the pinned host pages that swapped-out requests' KV lives in.

Every host page is free or holds one swapped request's page: `num_free + num_swapped == num_pages`.
Host pages are the same size in bytes as device pages (the runner holds the bytes), so a copy is one
page-sized block either way.
"""
from __future__ import annotations


class HostPagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._taken = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_swapped(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, num_pages: int) -> list[int] | None:
        if num_pages > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._taken[page] = True
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if not self._taken[page]:
                raise ValueError(f"host page {page} released but not taken")
            self._taken[page] = False
            self._free.append(page)

    def check(self) -> None:
        """Every page is free or taken, never both, and the free list holds each free page once."""
        assert len(set(self._free)) == len(self._free) and not any(self._taken[page] for page in self._free)
        assert sum(self._taken) == self.num_swapped
