"""DiskStore: the L3 tier's files. One file per page, named by the page's content hash under a directory per
fingerprint (model and KV layout), written atomically by a background thread, checked when read, bounded by size
with LRU eviction over every fingerprint, and found again by a new process (the index is rebuilt from the files).

    DIR/<fingerprint>/<hash hex>.page      header (HEADER: magic, version, fingerprint, hash, length, xxh64 of
                                           the payload) + payload (the page's bytes)

A file is written to `<name>.<pid>.tmp` and renamed, so a file cut by a kill mid-write is never under its final
name; at startup the `.tmp` files of processes no longer alive are removed. Two processes may share a directory (a
server and the successor a SIGUSR2 restart starts beside it): a page the other one writes later is found at its
first lookup (`contains` looks on disk when the index misses) and joins this store's index. A read (the header,
then the payload straight into the caller's buffer) whose header or checksum does not match is a miss: the file is
removed and counted (`num_corrupt`). An I/O error while writing (a full disk, a read-only directory) turns writing off with
one log line (`writes_disabled`); reads go on.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from tqdm import tqdm

logger = logging.getLogger("dflash2")

MAGIC = b"DF2KV"
VERSION = 1
# magic, version, fingerprint (32 bytes), hash length, hash (up to 64 bytes), payload length, xxh64 of the payload
HEADER = struct.Struct("<5sH32sB64sQQ")
SUFFIX = ".page"
PROGRESS_FROM = 10_000  # files: a rebuild of more shows a progress bar
MAX_PENDING_WRITES = 1024  # pages queued for writing at most (each one pinned in host memory until written)
WRITE_THREADS = 4
READ_THREADS = 4

Key = tuple[str, bytes]  # (fingerprint, content hash)


class DiskStore:
    def __init__(self, directory: str, capacity_bytes: int, page_bytes: int,
                 max_pending_writes: int = MAX_PENDING_WRITES) -> None:
        """Pages of `page_bytes` under `directory` (which must exist and be writable), `capacity_bytes` in all."""
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"the L3 cache directory {directory} does not exist")
        try:
            probe = self.directory / ".dflash2-writable"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"the L3 cache directory {directory} is not writable: {e.strerror}") from None
        self.capacity_bytes = capacity_bytes
        self.page_bytes = page_bytes
        self.file_bytes = HEADER.size + page_bytes
        self.max_pending_writes = max_pending_writes
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, None] = OrderedDict()  # pages on disk, LRU first
        self._writing: dict[Key, Future] = {}
        self.read_threads = READ_THREADS
        self._writer = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="dflash2-l3-write")
        self._reader = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="dflash2-l3-read")
        self.writes_disabled = False
        self.num_corrupt = 0
        self.num_writes_skipped = 0  # pages not written: the write queue was full
        self.num_reads = 0
        self.read_seconds = 0.0
        self.bytes_written = 0
        self.bytes_read = 0
        self.num_evictions = 0
        self._rebuild_index()

    # -- the index ----------------------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        """The files a previous process left, oldest first (by modification time); cut writes removed."""
        paths = [path for sub in self.directory.iterdir() if sub.is_dir() and len(sub.name) == 32
                 for path in sub.iterdir()]
        entries = []
        for path in tqdm(paths, desc="L3 cache index", unit="file", disable=len(paths) < PROGRESS_FROM):
            if path.name.endswith(".tmp"):
                if not _writer_alive(path):
                    path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    entries.append((path.stat().st_mtime, path.parent.name, bytes.fromhex(path.stem)))
                except (OSError, ValueError):
                    continue
        for _, fingerprint, content_hash in sorted(entries):
            self._index[(fingerprint, content_hash)] = None
        self._evict_to(self.capacity_bytes)
        if entries:
            logger.info("L3 cache: %d pages found in %s", len(self._index), self.directory)

    def contains(self, fingerprint: str, content_hash: bytes) -> bool:
        """Whether the page is on disk: in the index, or a file another process sharing the directory wrote
        since (it joins the index, most recently used; its checksum is checked when it is read)."""
        key = (fingerprint, content_hash)
        if key in self._index:  # a dict lookup: atomic under the GIL
            return True
        if not self._path(key).is_file():
            return False
        with self._lock:
            self._index[key] = None
            self._evict_to(self.capacity_bytes)
            return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return len(self._index) * self.file_bytes

    def _path(self, key: Key) -> Path:
        return self.directory / key[0] / (key[1].hex() + SUFFIX)

    def _evict_to(self, limit: int) -> None:
        """Drop the least recently used files until the store holds at most `limit` bytes (lock held or init)."""
        while self._index and len(self._index) * self.file_bytes > limit:
            key, _ = self._index.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            self.num_evictions += 1

    # -- writing ------------------------------------------------------------------------------------------
    @property
    def write_room(self) -> int:
        """Pages put() takes now before its queue is full (0 while writing is off)."""
        return 0 if self.writes_disabled else max(0, self.max_pending_writes - len(self._writing))

    def put(self, fingerprint: str, content_hash: bytes, payload: Any,
            ready: Callable[[], None] | None = None, bounded: bool = True) -> Future | None:
        """Write a page in the background: `payload` (bytes-like, page_bytes long) is read on the writer thread,
        after `ready()` if given (e.g. waiting for the copy that fills it). None: already there, being written,
        writing is off, or (`bounded`) max_pending_writes are queued already (the page is skipped)."""
        if memoryview(payload).nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {memoryview(payload).nbytes}")
        key = (fingerprint, content_hash)
        with self._lock:
            if self.writes_disabled or key in self._index or key in self._writing:
                return None
            if bounded and len(self._writing) >= self.max_pending_writes:
                self.num_writes_skipped += 1
                return None
            future = self._writing[key] = self._writer.submit(self._write, key, payload, ready)
        return future

    def _write(self, key: Key, payload: Any, ready: Callable[[], None] | None) -> bool:
        if ready is not None:
            ready()
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        view = memoryview(payload).cast("B")
        header = HEADER.pack(MAGIC, VERSION, key[0].encode(), len(key[1]), key[1], view.nbytes,
                             xxhash.xxh64_intdigest(view))
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temporary, "wb") as f:
                f.write(header)
                f.write(view)
            os.replace(temporary, path)
        except OSError as e:
            _remove(temporary)
            with self._lock:
                self._writing.pop(key, None)
                if not self.writes_disabled:
                    self.writes_disabled = True
                    logger.error("the L3 cache stops writing: %s (%s); serving goes on", e.strerror, self.directory)
            return False
        with self._lock:
            self._writing.pop(key, None)
            self._index[key] = None
            self.bytes_written += len(header) + view.nbytes
            self._evict_to(self.capacity_bytes)
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the writes queued so far; False if some were still going at the timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            pending = list(self._writing.values())
        for future in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(left)
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - a failed write is logged where it failed; flushing goes on
                continue
        return True

    # -- reading ------------------------------------------------------------------------------------------
    def get(self, fingerprint: str, content_hash: bytes, into: Any = None) -> Future:
        """Read a page in the background: a Future of True (its bytes copied into `into`, a writable buffer) or
        of the bytes (no `into`); None for a miss (absent, or corrupt and removed)."""
        return self._reader.submit(self._read, (fingerprint, content_hash), into)

    def _read(self, key: Key, into: Any) -> bytes | bool | None:
        """The file's header, then its payload read straight into `into` (or a new buffer): no copy in between."""
        path = self._path(key)
        started = time.perf_counter()
        payload = memoryview(bytearray(self.page_bytes) if into is None else into).cast("B")
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER.size)
                length = _read_into(f, payload) if len(header) == HEADER.size else 0
                past_end = f.read(1)
        except OSError:
            with self._lock:
                self._index.pop(key, None)
            return None
        ok = length == self.page_bytes and not past_end and self._checked(key, header, payload)
        with self._lock:
            if not ok:
                self._index.pop(key, None)
                self.num_corrupt += 1
            else:
                if key in self._index:
                    self._index.move_to_end(key)
                self.bytes_read += HEADER.size + length
                self.num_reads += 1
                self.read_seconds += time.perf_counter() - started
        if not ok:
            logger.warning("L3 cache file %s failed its check; removed (a miss)", path.name)
            _remove(path)
            return None
        return bytes(payload) if into is None else True

    def _checked(self, key: Key, header: bytes, payload: memoryview) -> bool:
        magic, version, fingerprint, hash_length, stored_hash, length, checksum = HEADER.unpack(header)
        return ((magic, version, fingerprint) == (MAGIC, VERSION, key[0].encode()) and length == len(payload)
                and stored_hash[:hash_length] == key[1] and xxhash.xxh64_intdigest(payload) == checksum)

    @property
    def avg_read_latency_s(self) -> float | None:
        return self.read_seconds / self.num_reads if self.num_reads else None

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)


def _read_into(f: Any, buffer: memoryview) -> int:
    """Fill `buffer` from an unbuffered file (a read may return less than asked); the bytes read."""
    done = 0
    while done < len(buffer):
        count = f.readinto(buffer[done:])
        if not count:
            break
        done += count
    return done


def _writer_alive(temporary: Path) -> bool:
    """Whether the process that is writing this `.tmp` file (its name's pid) is still running."""
    try:
        pid = int(temporary.name.rsplit(".", 2)[-2])
    except ValueError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # its directory went away or is not one any more
        pass
