"""The engine's side of the L3 (disk) tier: building it from CacheConfig, each model's fingerprint for its files,
the prefill rate the tier weighs a read against, and writing the prefix cache down at close (a new server starts
warm). The tier itself: kv/disk_tier.py and kv/disk_store.py."""
from __future__ import annotations

import logging
import os
import shutil
import time

import torch

from dflash2.config import CacheConfig
from dflash2.engine.kv.disk_store import DiskStore
from dflash2.engine.kv.disk_tier import DiskTier, fingerprint
from dflash2.engine.kv.host_pool import HostPagePool
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.plan import StepPlan
from dflash2.engine.served_model import PreparedModel
from dflash2.engine.storage import PoolStorage

logger = logging.getLogger("dflash2")

PREFILL_RATE_MIN_TOKENS = 256  # steps with fewer prompt tokens tell little about the prefill rate


def build_disk_tier(cache: CacheConfig, host_pool: HostPagePool, storage: PoolStorage) -> DiskTier:
    size = cache.l3_cache_size_bytes
    if size is None:
        if not os.path.isdir(cache.l3_cache_path):
            raise ValueError(f"the L3 cache directory {cache.l3_cache_path} does not exist")
        size = int(shutil.disk_usage(cache.l3_cache_path).free * CacheConfig.L3_DEFAULT_FREE_SHARE)
        logger.info("L3 cache size: %.1f GiB (%d%% of the free space in %s)", size / (1 << 30),
                    int(CacheConfig.L3_DEFAULT_FREE_SHARE * 100), cache.l3_cache_path)
    store = DiskStore(cache.l3_cache_path, size, cache.page_bytes)
    return DiskTier(store, host_pool, storage.host_pages, storage.copies_done)


def model_fingerprint(prepared: PreparedModel) -> str:
    """The L3 files' fingerprint of a model: its name, weights (path, size and time of the file or directory),
    formats and KV layout."""
    spec, path = prepared.spec, prepared.spec.model
    stat = os.stat(path) if path is not None and os.path.exists(path) else None
    return fingerprint(prepared.name, path, stat and (stat.st_size, stat.st_mtime_ns), spec.load_format, spec.dtype,
                       spec.quantization, prepared.model.dtype, prepared.layout)


def persist_tiers(disk_tier: DiskTier, device: torch.device, pool: PagePool, host_pool: HostPagePool,
                  storage: PoolStorage, timeout: float) -> None:
    """Write the prefix cache's pages on the device and in host memory down to disk, so that a new server
    starts warm (at most `timeout` seconds; what is left then is lost)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    disk_tier.poll()
    pages = pool.cached_pages() + host_pool.cached_pages()
    done = disk_tier.persist([(_page_bytes_on_host(storage, where, page), content_hash, owner)
                              for where, page, content_hash, owner in pages], timeout)
    logger.info("L3 cache: %d pages written down at shutdown%s", len(pages),
                "" if done else f" (not all within {timeout:g} s)")


def _page_bytes_on_host(storage: PoolStorage, where: str, page: int) -> torch.Tensor:
    if where == "host":
        return storage.host_pages[page]
    return storage.device_pages[page].cpu()


class PrefillRate:
    """The prefill rate the disk tier weighs a read against: prompt tokens a second of steps that are mostly
    prefill (a step's time: from the previous step's results to its own, the device busy in between)."""

    def __init__(self, disk_tier: DiskTier) -> None:
        self.disk_tier = disk_tier
        self._last_result_time: float | None = None  # when the latest step's results were in

    def measure(self, plan: StepPlan) -> None:
        """Called as each step's results are in."""
        now = time.perf_counter()
        last, self._last_result_time = self._last_result_time, now
        tokens = sum(chunk.num_tokens for chunk in plan.chunks if not chunk.is_decode)
        if last is None or tokens < PREFILL_RATE_MIN_TOKENS or now <= last:
            return
        rate = tokens / (now - last)
        known = self.disk_tier.prefill_tokens_per_s
        self.disk_tier.prefill_tokens_per_s = rate if known is None else 0.8 * known + 0.2 * rate
