"""DiskStore, the L3 tier's files: written atomically in the background, read back checked, bounded by size (LRU),
found again by a new store on the same directory, corrupt or cut files treated as misses."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

from dflash2.engine.kv.disk_store import HEADER, DiskStore

FP = "0123456789abcdef0123456789abcdef"
PAGE = 64


def page(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAGE))


class Store:
    """A DiskStore seen through one fingerprint (the tests' shorthand)."""

    def __init__(self, path, pages: int = 4, fingerprint: str = FP) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.disk = DiskStore(str(path), pages * (HEADER.size + PAGE), PAGE)
        self.fingerprint = fingerprint
        self.directory = self.disk.directory / fingerprint

    def __getattr__(self, name):
        return getattr(self.disk, name)

    def __contains__(self, content_hash: bytes) -> bool:
        return self.disk.contains(self.fingerprint, content_hash)

    def put(self, content_hash: bytes, payload: bytes):
        return self.disk.put(self.fingerprint, content_hash, payload)

    def get(self, content_hash: bytes, into=None):
        return self.disk.get(self.fingerprint, content_hash, into)


def store(tmp_path, pages: int = 4, fingerprint: str = FP) -> Store:
    return Store(tmp_path, pages, fingerprint)


def test_a_page_written_is_read_back_and_found_by_a_new_store(tmp_path):
    first = store(tmp_path)
    first.put(b"h1", page(1)).result()
    assert b"h1" in first and first.get(b"h1").result() == page(1)
    assert first.put(b"h1", page(1)) is None  # there already
    first.close()
    second = store(tmp_path)
    assert b"h1" in second and second.get(b"h1").result() == page(1)
    other = store(tmp_path, fingerprint="f" * 32)  # another model or layout: nothing in common
    assert b"h1" not in other and other.get(b"h1").result() is None
    into = bytearray(PAGE)
    assert second.get(b"h1", into).result() is True and bytes(into) == page(1)


def test_the_store_keeps_its_size_by_dropping_the_least_recently_used(tmp_path):
    disk = store(tmp_path, pages=2)
    disk.put(b"a", page(1)).result()
    disk.put(b"b", page(2)).result()
    assert disk.get(b"a").result() == page(1)  # a is used: b goes first
    disk.put(b"c", page(3)).result()
    assert b"a" in disk and b"c" in disk and b"b" not in disk and disk.num_evictions == 1
    assert sorted(p.name for p in disk.directory.iterdir()) == [b"a".hex() + ".page", b"c".hex() + ".page"]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_cut_file_is_a_miss_and_is_removed(tmp_path, damage):
    disk = store(tmp_path)
    disk.put(b"h", page(5)).result()
    path = disk.directory / (b"h".hex() + ".page")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
    else:
        del data[-10:]
    path.write_bytes(bytes(data))
    assert disk.get(b"h").result() is None
    assert disk.num_corrupt == 1 and not path.exists() and b"h" not in disk


def test_a_write_cut_by_a_kill_is_never_served_and_a_live_writer_keeps_its_file(tmp_path):
    disk = store(tmp_path)
    disk.directory.mkdir(exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (disk.directory / f"{b'h'.hex()}.page.{dead.pid}.tmp").write_bytes(b"half a page")  # its writer was killed
    live = disk.directory / f"{b'i'.hex()}.page.{os.getppid()}.tmp"  # another server writing right now
    live.write_bytes(b"being written")
    disk.close()
    again = store(tmp_path)
    assert b"h" not in again and b"i" not in again and list(again.directory.iterdir()) == [live]


def test_a_page_another_process_writes_later_is_found_by_a_store_started_before(tmp_path):
    old, new = store(tmp_path), store(tmp_path)  # a server and the successor a restart starts beside it
    assert b"h" not in new
    old.put(b"h", page(7)).result()
    assert b"h" in new and len(new.disk) == 1 and new.get(b"h").result() == page(7)


def test_a_directory_that_cannot_be_written_is_refused_and_a_failing_write_turns_writing_off(tmp_path):
    if os.geteuid() == 0:
        locked = tmp_path / "file-not-dir"
        locked.write_text("x")  # root may write anywhere: a path under a file cannot be made
        with pytest.raises(ValueError, match="does not exist"):
            DiskStore(str(locked / "l3"), 1 << 20, PAGE)
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(ValueError, match="is not writable"):
            DiskStore(str(locked), 1 << 20, PAGE)
    with pytest.raises(ValueError, match="does not exist"):
        DiskStore(str(tmp_path / "missing"), 1 << 20, PAGE)
    disk = store(tmp_path / "ok")
    disk.put(b"a", page(1)).result()
    for path in disk.directory.iterdir():
        path.unlink()
    disk.directory.rmdir()
    disk.disk.directory.rmdir()  # the directory goes away under it: the next write fails
    disk.put(b"b", page(2)).result()
    assert disk.writes_disabled and b"b" not in disk
    assert disk.put(b"c", page(3)) is None  # off from then on
    with pytest.raises(ValueError, match="a page is 64 bytes"):
        disk.put(b"d", b"short")
