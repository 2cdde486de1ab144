"""The disk reader's read-ahead: what it asks of the kernel, how far ahead, and that the kernel reads
it (pages counted resident with `mincore` on a real file)."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from pathlib import Path

import pytest

from audit.readers import readahead
from audit.readers.readahead import CALL_BYTES, ReadAhead, calls
from tests.readers.willneed import WillNeedCalls

MiB = 1 << 20


def test_calls_join_what_follows_in_a_file_and_cut_at_the_kernels_most():
    a, b = Path("a.bucket"), Path("b.bucket")
    extents = [(a, 0, 3 * MiB), (a, 3 * MiB, 7 * MiB), (a, 12 * MiB, MiB), (b, 0, 0), (b, 0, MiB), (a, 13 * MiB, MiB)]
    assert calls(extents) == [(a, 0, CALL_BYTES), (a, CALL_BYTES, 10 * MiB - CALL_BYTES),
                              (a, 12 * MiB, MiB), (b, 0, MiB), (a, 13 * MiB, MiB)]


def test_it_asks_in_order_and_never_more_than_the_window_past_the_batch_reached(tmp_path, monkeypatch):
    files = [tmp_path / f"{index}.bucket" for index in range(2)]
    for file in files:
        file.write_bytes(bytes(8 * MiB))
    asked = WillNeedCalls(monkeypatch)
    extents = [(file, offset, MiB) for file in files for offset in range(0, 8 * MiB, 2 * MiB)]  # gaps: no joins
    ahead = ReadAhead(extents, window=3 * MiB)
    try:
        assert asked.settled(3) == [(str(files[0]), offset, MiB) for offset in (0, 2 * MiB, 4 * MiB)]
        ahead.reached(4 * MiB)  # the fifth value's batch is being mapped: up to 7 MiB of the plan
        assert asked.settled(7)[3:] == [(str(files[0]), 6 * MiB, MiB), *[(str(files[1]), offset, MiB)
                                                                         for offset in (0, 2 * MiB, 4 * MiB)]]
        ahead.reached(2 * MiB)  # behind what it reached: nothing more
        assert len(asked.settled(7)) == 7
    finally:
        ahead.close()
    assert len(asked.calls) == 7  # closed while waiting: it asks for nothing more


def test_a_file_gone_since_it_was_indexed_is_passed_over(tmp_path, monkeypatch):
    asked = WillNeedCalls(monkeypatch)
    kept = tmp_path / "kept.bucket"
    kept.write_bytes(bytes(MiB))
    ahead = ReadAhead([(tmp_path / "gone.bucket", 0, MiB), (kept, 0, MiB)], window=4 * MiB)
    try:
        assert asked.settled(1) == [(str(kept), 0, MiB)]
    finally:
        ahead.close()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _resident(path: Path) -> bytes:
    """One byte a page of `path`: 1 where the page cache holds it (`mincore`)."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as file:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0)
    assert address != ctypes.c_void_p(-1).value, os.strerror(ctypes.get_errno())
    try:
        vector = ctypes.create_string_buffer(pages)
        assert _libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        return bytes(b & 1 for b in vector.raw)
    finally:
        _libc.munmap(address, size)


def _dropped(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_kernel_reads_what_it_asks_for_and_no_further():
    """On a disk the page cache can drop: beside the repository, where /tmp may be tmpfs."""
    with tempfile.TemporaryDirectory(dir=REPOSITORY, prefix=".readahead-") as scratch:
        _reads_what_it_asks_for(Path(scratch) / "0.bucket")


def _reads_what_it_asks_for(bucket: Path) -> None:
    bucket.write_bytes(os.urandom(32 * MiB))
    _dropped(bucket)
    page_mib = MiB // mmap.PAGESIZE
    assert sum(_resident(bucket)) == 0, "the page cache kept the file: this test needs a disk, not tmpfs"
    ahead = ReadAhead([(bucket, offset, MiB) for offset in range(0, 32 * MiB, MiB)], window=8 * MiB)
    try:
        deadline = time.monotonic() + 10
        while sum(_resident(bucket)[:8 * page_mib]) < 8 * page_mib and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        resident = _resident(bucket)
        assert sum(resident[:8 * page_mib]) == 8 * page_mib
        assert sum(resident[16 * page_mib:]) == 0  # beyond the window (and the kernel's own read-around)
        ahead.reached(24 * MiB)
        deadline = time.monotonic() + 10
        while sum(_resident(bucket)) < 32 * page_mib and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(_resident(bucket)) == 32 * page_mib
    finally:
        ahead.close()


def test_a_window_is_an_eighth_of_the_memory_available_at_most():
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:"))
    assert readahead.window_bytes() == pytest.approx(min(readahead.WINDOW_BYTES, available // 8), rel=0.05)
