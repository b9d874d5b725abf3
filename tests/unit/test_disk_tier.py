"""DiskTier's write-down and its read decision, on a real DiskStore in a temporary directory and a real host pool:
a full write queue delays pages, it does not skip them; a fetch is weighed with the readers side by side."""
from __future__ import annotations

import threading

import torch

from dflash2.engine.kv.disk_store import DiskStore, HEADER
from dflash2.engine.kv.disk_tier import DiskTier
from dflash2.engine.kv.host_pool import HostPagePool

PAGE = 64


def tier(tmp_path, num_pages: int, max_pending_writes: int, ready=None) -> DiskTier:
    store = DiskStore(str(tmp_path), 100 * (HEADER.size + PAGE), PAGE, max_pending_writes=max_pending_writes)
    host_pages = torch.arange(num_pages * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8).view(num_pages,
                                                                                                       PAGE)
    disk = DiskTier(store, HostPagePool(num_pages), host_pages, lambda: ready)
    disk.add_model("m", "0123456789abcdef0123456789abcdef")
    return disk


def test_a_full_write_queue_delays_pages_instead_of_skipping_them(tmp_path):
    gate = threading.Event()
    disk = tier(tmp_path, num_pages=6, max_pending_writes=2, ready=gate.wait)
    disk.host_pool.store([(bytes([i]), "m") for i in range(6)])
    disk.write_ahead()  # room for two: pages 0 and 1, pinned while their writes wait at the gate
    assert disk.store.write_room == 0 and disk.host_pool.num_evictable == 4
    disk.write_ahead()
    assert disk.store.num_writes_skipped == 0  # nothing asked of the full queue
    gate.set()
    while len(disk.store) < 6:  # each write_ahead queues what the queue has room for, the next to leave first
        assert disk.store.flush(10)
        disk.poll()
        disk.write_ahead()
    disk.store.flush(10)
    disk.poll()
    assert all(disk.store.contains("0123456789abcdef0123456789abcdef", bytes([i])) for i in range(6))
    assert disk.store.num_writes_skipped == 0 and disk.host_pool.num_evictable == 6
    disk.host_pool.check()
    disk.close()


def test_a_fetch_is_weighed_with_the_readers_reading_side_by_side(tmp_path):
    disk = tier(tmp_path, num_pages=4, max_pending_writes=4)
    assert disk.worth_loading(8, 64)  # nothing measured yet: read
    disk.prefill_tokens_per_s = 16_000.0  # a page of 8 tokens computes in 0.5 ms
    disk.store.num_reads, disk.store.read_seconds = 10, 10 * 0.0012  # a read takes 1.2 ms, 4 readers
    assert disk.store.read_threads == 4
    assert disk.worth_loading(8, 64)  # 2 rounds of 1.2 ms against 4 ms of compute
    assert not disk.worth_loading(1, 8)  # one read of 1.2 ms against 0.5 ms
    disk.store.read_seconds = 10 * 0.003
    assert not disk.worth_loading(8, 64)  # 2 rounds of 3 ms against 4 ms
    disk.close()
