"""KVManager: the page table of each request of one model, on a shared PagePool.

    request.token_ids:  [ t0 t1 ... | ... | ...  tN ]
    pages:              [  page a   | page b | page c (partly filled) ]
    hashed:             [  yes      |  yes   |  no: only full pages get a content hash ]

A request owns one reference to each page in its table. Full pages are hashed (chained over the prefix)
once their KV is computed, so a later request with the same prefix acquires them instead of recomputing.

Each request holding pages also holds a slot: the row of the runner's device page table that mirrors its
page list. `take_new_pages()` hands out the pages added since the last call, so the runner updates that row
in place instead of receiving the whole table every step.

Swapping (priority preemption): `swap_out` moves a request's computed pages to host pages (the caller
copies the bytes before the step's kernels run), releasing its device pages and slot; `swap_in` takes new
device pages for them when it resumes. While swapped, a request holds host pages only. When host memory is full
of swapped pages and a disk tier (L3) is there, `spill` hands a swapped request's full pages to the prefix cache,
to be written down: it resumes through a prefix hit on host memory or disk instead of a swap-in.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.kv.prefix_hash import chain_hashes, page_hash
from dflash2.request import Request

if TYPE_CHECKING:
    from dflash2.engine.kv.disk_tier import DiskTier


@dataclass(slots=True)
class PrefixHit:
    """A request's cached prefix across the tiers, in order: device pages, then host pages, then disk pages."""

    pages: list[int]  # device pages
    hashes: list[bytes]  # the device and host pages' content hashes
    host: list[int]  # host pages
    disk: list[bytes]  # content hashes of pages on disk

    @property
    def num_pages(self) -> int:
        return len(self.pages) + len(self.host) + len(self.disk)


class KVManager:
    def __init__(self, pool: PagePool, tokens_per_page: int, namespace: str,
                 enable_prefix_caching: bool = True, max_slots: int = 1024,
                 host_pool: HostPagePool | None = None) -> None:
        if tokens_per_page < 1:
            raise ValueError("a page must hold at least one token")
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching
        self._pages: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's leading full pages
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._num_synced: dict[str, int] = {}  # pages already handed to the runner
        self.host_pool = host_pool
        self._swapped: dict[str, list[int]] = {}  # request id -> host pages, in page-table order
        self._swapped_hashes: dict[str, list[bytes]] = {}  # request id -> its full swapped pages' hashes
        self._lookup_chains: dict[str, tuple[int, list[bytes]]] = {}  # request id -> (num_tokens, page hashes)
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found (on the device or in host memory)
        self.num_prefix_hits_host = 0  # of those, tokens brought up from host memory
        self.num_prefix_hits_disk = 0  # of those, tokens read from disk (through host memory)
        self.num_spills = 0  # swapped requests spilled to disk (their pages handed to the prefix cache)
        self.disk: DiskTier | None = None  # the L3 tier, when there is one

    @property
    def num_available(self) -> int:
        """Pages this model can take now (the pool's free and evictable pages, within the models' limits)."""
        return self.pool.available_for(self.namespace)

    @property
    def num_used(self) -> int:
        return self.pool.num_used_by(self.namespace)

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached_by(self.namespace)

    def pages_of(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    def slot_of(self, request_id: str) -> int:
        return self._slot[request_id]

    def take_new_pages(self, request_id: str) -> tuple[int, tuple[int, ...]]:
        """(index of the first page not yet handed out, those pages), and mark them handed out."""
        pages = self._pages[request_id]
        start = self._num_synced[request_id]
        self._num_synced[request_id] = len(pages)
        return start, tuple(pages[start:])

    # -- swapping ------------------------------------------------------------------------------------
    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    @property
    def num_swapped_requests(self) -> int:
        return len(self._swapped)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed pages to host pages: [(device page, host page)], or None (no room;
        nothing changed). Its device pages and slot are released; the bytes must be copied before reuse."""
        count = self.num_pages_for(request.num_computed_tokens)
        if self.host_pool is None or count == 0:
            return None
        host = self.host_pool.allocate(count)
        if host is None:
            return None
        device = self._pages[request.request_id][:count]
        hashes = self._hashes.get(request.request_id, [])[:count]
        self.free(request)
        self._swapped[request.request_id] = host
        self._swapped_hashes[request.request_id] = hashes
        return list(zip(device, host))

    def spill(self, request: Request) -> list[int]:
        """Turn a swapped request's full host pages into cached pages of the prefix cache, pinned until the disk
        tier has written them (L3); its other pages are freed. The request holds no pages after: it computes
        from its prompt again, and its prefix comes back as a host or disk hit. Returns the pages to write."""
        host = self._swapped.pop(request.request_id)
        hashes = self._swapped_hashes.pop(request.request_id)
        kept = [page for page, content_hash in zip(host, hashes)
                if self.host_pool.keep(page, content_hash, self.namespace)]
        self.host_pool.release(host[len(hashes):])
        request.num_computed_tokens = 0
        self.num_spills += 1
        return kept

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """New device pages for a swapped request: [(host page, device page)], or None (not enough)."""
        host = self._swapped[request.request_id]
        device = self.pool.allocate(len(host), self.namespace)
        if device is None:
            return None
        self._open(request.request_id).extend(device)
        del self._swapped[request.request_id]
        self._swapped_hashes.pop(request.request_id, None)
        self.host_pool.release(host)
        return list(zip(host, device))

    def _open(self, request_id: str) -> list[int]:
        """The request's page list, giving it a slot first if it has none."""
        if request_id not in self._pages:
            if not self._free_slots:
                raise RuntimeError(f"all {self.max_slots} page-table slots are taken")
            self._slot[request_id] = self._free_slots.pop()
            self._num_synced[request_id] = 0
            self._pages[request_id] = []
            self._hashes[request_id] = []
        return self._pages[request_id]

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def lookup_prefix(self, request: Request, with_disk: bool = False) -> PrefixHit:
        """The request's longest cached prefix, not yet acquired: its pages on the device, then the pages that
        continue it in host memory (L2: brought up by attach_prefix), then (`with_disk`) the hashes that continue
        it on disk (L3: read up to host memory first, by the disk tier's fetch).

        At least one token is left to compute, since the step that computes it yields the next logits.
        """
        hit = PrefixHit([], [], [], [])
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return hit
        for content_hash in self._lookup_chain(request):
            if not hit.host and not hit.disk:
                page = self.pool.lookup(content_hash)
                if page is not None:
                    hit.pages.append(page)
                    hit.hashes.append(content_hash)
                    continue
            if not hit.disk and self.host_pool is not None:
                page = self.host_pool.lookup(content_hash)
                if page is not None:
                    hit.host.append(page)
                    hit.hashes.append(content_hash)
                    continue
            if with_disk and self.disk is not None and self.disk.contains(self.namespace, content_hash):
                hit.disk.append(content_hash)
                continue
            break
        return hit

    def _lookup_chain(self, request: Request) -> list[bytes]:
        """Hashes of the full pages of the request's tokens but the last, computed once per token count: the
        scheduler asks about a waiting request every step (and once per candidate victim)."""
        cached = self._lookup_chains.get(request.request_id)
        if cached is None or cached[0] != request.num_tokens:
            cached = (request.num_tokens, chain_hashes(request.token_ids[:request.num_tokens - 1],
                                                       self.tokens_per_page, self.namespace))
            self._lookup_chains[request.request_id] = cached
        return cached[1]

    def pages_needed(self, request: Request, chunk_tokens: int) -> int:
        """Pages that admitting a request without pages, with a first chunk of `chunk_tokens` after its cached
        prefix, takes out of `num_available` (its prefix pages now idle in the cache count too, and a page of it
        in host memory needs a device page)."""
        hit = self.lookup_prefix(request)
        idle = sum(1 for page in hit.pages if self.pool.refcount(page) == 0)
        covered = (len(hit.pages) + len(hit.host)) * self.tokens_per_page
        return idle + self.num_pages_for(covered + chunk_tokens) - len(hit.pages)

    def attach_prefix(self, request: Request) -> tuple[int, list[tuple[int, int]]]:
        """Give a request with no pages the cached pages of its longest hashed prefix: (tokens reused, the
        (host page, device page) copies that bring its host-memory part up; the caller puts them in the step's
        plan, before its kernels). The host part is taken only if device pages for it are available."""
        assert request.request_id not in self._pages, "prefix lookup is for requests without pages"
        hit = self.lookup_prefix(request)
        pages, hashes, host = hit.pages, hit.hashes, hit.host
        promoted: list[tuple[int, int]] = []
        if host:
            for page in pages:  # the device part first: allocating for the host part may evict idle pages
                self.pool.acquire(page)
            device = self.pool.allocate(len(host), self.namespace)
            if device is None:
                hashes = hashes[:len(pages)]
            else:
                from_disk = self.disk.from_disk if self.disk is not None else set()
                for host_page, device_page, content_hash in zip(host, device, hashes[len(pages):]):
                    self.host_pool.touch(host_page)  # it stays in host memory too
                    self.pool.register(device_page, content_hash)
                    promoted.append((host_page, device_page))
                    if content_hash in from_disk:
                        from_disk.discard(content_hash)
                        self.num_prefix_hits_disk += self.tokens_per_page
                    else:
                        self.num_prefix_hits_host += self.tokens_per_page
                pages = pages + device
        else:
            for page in pages:
                self.pool.acquire(page)
        self._open(request.request_id).extend(pages)
        self._hashes[request.request_id] = hashes
        self._lookup_chains.pop(request.request_id, None)
        return len(pages) * self.tokens_per_page, promoted

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (for the hit ratio)."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        missing = self.num_pages_for(num_tokens) - len(self.pages_of(request.request_id))
        return missing <= self.num_available

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (nothing changed) if pages ran out."""
        pages = self._open(request.request_id)
        missing = self.num_pages_for(num_tokens) - len(pages)
        if missing <= 0:
            return True
        new_pages = self.pool.allocate(missing, self.namespace)
        if new_pages is None:
            return False
        pages.extend(new_pages)
        return True

    def commit(self, request: Request) -> None:
        """Hash the pages that became full of computed KV (call after num_computed_tokens moved)."""
        if not self.enable_prefix_caching or request.request_id not in self._pages:
            return
        pages = self._pages[request.request_id]
        hashes = self._hashes[request.request_id]
        num_full = min(request.num_computed_tokens // self.tokens_per_page, len(pages))
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.token_ids[i * self.tokens_per_page:(i + 1) * self.tokens_per_page]
            content_hash = page_hash(parent, tokens, self.namespace)
            self.pool.register(pages[i], content_hash)
            hashes.append(content_hash)

    def free(self, request: Request) -> None:
        """Drop the request's pages; the tail goes first so that LRU eviction takes it before the prefix."""
        host = self._swapped.pop(request.request_id, None)
        self._swapped_hashes.pop(request.request_id, None)
        if host is not None:
            self.host_pool.release(host)
        pages = self._pages.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._lookup_chains.pop(request.request_id, None)
        self._num_synced.pop(request.request_id, None)
        slot = self._slot.pop(request.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self.pool.release(list(reversed(pages)))
