"""DiskTier: the L3 tier between host pages and the DiskStore's files, for every model of one pool.

    down: the host pages are written to disk in the background in the order they will leave host memory (L2:
          its ring order from the cursor on), as many as the write queue has room for at each step (the scan
          resumes where it stopped, so a full queue delays a page, it does not skip it); each is pinned (never
          evicted) until its write is in; the writers wait for the device copies queued so far first. So a page
          leaving host memory is on disk already (unless writing was off, or the writers fell a whole lap behind),
          and each page is written once, not each time it comes down. A paused request spilled when host memory is
          full of swapped pages (KVManager.spill) has its pages written with the next write_ahead, pinned until
          then.
    up:   a waiting request whose prefix goes on past host memory into files starts a fetch: host pages are
          reserved (loading) and the files are read into them by reader threads, checked; the scheduler admits
          the request once its reads are in (poll: the pages are then cached in host memory and come up like any
          host hit), or at its deadline, computing what was not read.

Only the scheduler's thread calls these methods; the threads report through `_done`, drained by poll().
Whether a fetch pays is worth_loading(): the measured read time of a page (the reader threads reading side by side)
against the measured prefill rate.
"""
from __future__ import annotations

import hashlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash2.engine.kv.disk_store import DiskStore
from dflash2.engine.kv.host_pool import HostPagePool

# A fetch waits at least MIN_DEADLINE_S, else DEADLINE_FACTOR times its expected time.
MIN_DEADLINE_S = 0.05
DEADLINE_FACTOR = 4.0
DEFAULT_READ_S = 0.002  # a page's read, for a deadline until reads have been timed


def fingerprint(*parts: object) -> str:
    """32 hex digits naming a model and its KV layout: pages of another never mix in."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


@dataclass
class Fetch:
    hashes: list[bytes]
    deadline: float


class DiskTier:
    def __init__(self, store: DiskStore, host_pool: HostPagePool, host_pages: torch.Tensor,
                 copy_done: Callable[[], Callable[[], None] | None]) -> None:
        """`host_pages`: the host pages' bytes (num_pages x page_bytes, uint8); `copy_done()`: a wait for the
        device copies queued so far (None when they are done already: the CPU)."""
        self.store = store
        self.host_pool = host_pool
        self.host_pages = host_pages
        self._copy_done = copy_done
        self._fingerprints: dict[str | None, str] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._loading: dict[bytes, int] = {}  # content hash -> host page it is read into
        self._fetches: dict[str, Fetch] = {}  # request id -> its fetch
        self._spilled: list[int] = []  # pinned host pages of spilled requests, written with the next write_ahead
        self.from_disk: set[bytes] = set()  # hashes read from disk, not yet brought up to the device
        self.prefill_tokens_per_s: float | None = None  # measured by the engine

    # -- models --------------------------------------------------------------------------------------
    def add_model(self, name: str | None, model_fingerprint: str) -> None:
        self._fingerprints[name] = model_fingerprint

    def remove_model(self, name: str | None) -> None:
        self._fingerprints.pop(name, None)

    def contains(self, owner: str | None, content_hash: bytes) -> bool:
        return content_hash in self._loading or self.store.contains(self._fingerprints[owner], content_hash)

    # -- down ----------------------------------------------------------------------------------------
    def write_spilled(self, pages: list[int]) -> None:
        """Write these pinned cached host pages (a spilled paused request's) with the next write_ahead: after the
        launch that queues the copies down into them."""
        self._spilled.extend(pages)

    def write_ahead(self) -> None:
        """Start writing the spilled pages and the host pages about to leave host memory (call after a step's
        copies are queued)."""
        spilled, self._spilled = self._spilled, []
        if self.store.writes_disabled:
            for page in spilled:
                self.host_pool.unpin(page)
            return
        pages = [(page, self.host_pool.hash_of(page), self.host_pool.owner_of(page)) for page in spilled]
        pages += self.host_pool.pages_ahead(self.host_pool.num_pages, max(0, self.store.write_room - len(pages)))
        if not pages:
            return
        ready = self._copy_done()
        for page, content_hash, owner in pages:
            model = self._fingerprints.get(owner)
            if model is not None and self.store.contains(model, content_hash):
                self.host_pool.unpin(page)
                self.host_pool.mark_on_disk(page)
                continue
            future = None if model is None else self.store.put(model, content_hash, self.host_pages[page].numpy(),
                                                                ready)
            if future is None:  # its model was unloaded, or the write queue is full
                self.host_pool.unpin(page)
                continue
            self.host_pool.pin(page)
            future.add_done_callback(lambda f, page=page: self._done.put(("written", page, _succeeded(f))))

    # -- up ------------------------------------------------------------------------------------------
    def worth_loading(self, num_pages: int, num_tokens: int) -> bool:
        """Whether reading `num_pages` pages is expected to be faster than computing their `num_tokens` tokens."""
        if self.prefill_tokens_per_s is None or self.store.avg_read_latency_s is None:
            return True  # nothing measured yet: read (the reads measure themselves)
        return self._read_s(num_pages) < num_tokens / self.prefill_tokens_per_s

    def _read_s(self, num_pages: int) -> float:
        """The expected time to read `num_pages` pages, the readers taking them side by side (DEFAULT_READ_S a
        page until reads have been timed)."""
        latency = self.store.avg_read_latency_s
        return -(-num_pages // self.store.read_threads) * (DEFAULT_READ_S if latency is None else latency)

    def fetch(self, request_id: str, owner: str | None, hashes: list[bytes], now: float) -> bool:
        """Bring the request's disk pages (in prefix order) up to host memory; True while its reads are going and
        its deadline has not passed (the request waits), False once they are in or given up on."""
        current = self._fetches.get(request_id)
        if current is None:
            room = self.host_pool.num_free + self.host_pool.num_evictable
            hashes = hashes[:len([h for h in hashes if h in self._loading]) + room]  # the prefix that fits
            todo = [h for h in hashes if h not in self._loading]
            pages = self.host_pool.reserve(len(todo)) if todo else []
            if pages is None or not hashes:
                return False  # no host page free or evictable: compute instead
            for content_hash, page in zip(todo, pages):
                self._loading[content_hash] = page
                future = self.store.get(self._fingerprints[owner], content_hash, self.host_pages[page].numpy())
                future.add_done_callback(
                    lambda f, h=content_hash, p=page, o=owner: self._done.put(("read", p, (h, o, _succeeded(f)))))
            expected = self._read_s(len(hashes))
            current = self._fetches[request_id] = Fetch(hashes, now + max(MIN_DEADLINE_S, DEADLINE_FACTOR * expected))
        if now < current.deadline and any(h in self._loading for h in current.hashes):
            return True
        del self._fetches[request_id]
        return False

    def forget_fetch(self, request_id: str) -> None:
        self._fetches.pop(request_id, None)

    def poll(self) -> None:
        """Take in what the threads finished: written pages unpinned, read pages cached in host memory (or
        freed when the read missed)."""
        while True:
            try:
                kind, page, detail = self._done.get_nowait()
            except queue.Empty:
                return
            if kind == "written":
                self.host_pool.unpin(page)
                if detail:
                    self.host_pool.mark_on_disk(page)
                continue
            content_hash, owner, ok = detail
            del self._loading[content_hash]
            if ok:
                self.host_pool.fill(page, content_hash, owner)
                self.from_disk.add(content_hash)
            else:
                self.host_pool.unload(page)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def check(self) -> None:
        """The host pool's loading pages are exactly the reads this tier is waiting for."""
        assert self.host_pool.num_loading == len(self._loading) == len(set(self._loading.values()))

    # -- shutdown -------------------------------------------------------------------------------------
    def persist(self, pages: list[tuple[torch.Tensor, bytes, str | None]], timeout_s: float) -> bool:
        """Write pages given as (host bytes, hash, owner) and wait for every write queued, at most `timeout_s`."""
        for payload, content_hash, owner in pages:
            self.store.put(self._fingerprints[owner], content_hash, payload.numpy(), bounded=False)
        return self.store.flush(timeout_s)

    def close(self) -> None:
        self.store.close()
        self.poll()


def _succeeded(future) -> bool:
    return future.exception() is None and bool(future.result())
