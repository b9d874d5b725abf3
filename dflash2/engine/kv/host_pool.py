"""HostPagePool: bookkeeping for the pinned host pages that swapped-out requests' KV lives in.

Every host page is free or holds one swapped request's page: `num_free + num_swapped == num_pages`.
Host pages are the same size in bytes as device pages, so a copy is one page-sized block either way.
"""
from __future__ import annotations


class HostPagePool:
    def __init__(self, num_pages: int, page_bytes: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
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
        assert self.num_free + self.num_swapped == self.num_pages
        assert sum(self._taken) == self.num_swapped
