"""Offload files mapped where a batch's values are checked: the checks read the page cache in place.

Copying a value out of its file (`preadv`) is a pass over its bytes as long as the checks' own;
mapping it costs a page-table entry per page. A window is one range of address space, anonymous
zero pages until a value's file pages are mapped over part of it (`MAP_FIXED`), so a batch's
values lie in one array at the offsets their slots name, as the other readers' buffers hold them.
A value starts where it lies in its page, not on a cache line: the checks accept any offset.

The mapping is private: a write into the array copies the page and never reaches the file. The
reader checks the file's length before it maps: a value past the end of its file (truncated) is
a failed read, never a mapping; the bucket backend writes a file once and never shortens it.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10  # Linux, every architecture
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def window_bytes(sizes: list[int]) -> int:
    """The window that holds values of `sizes` wherever each lies in its first page."""
    return sum(size + 2 * PAGE for size in sizes) + PAGE


class MappedWindow:
    """Address space for one batch of mapped values; `array` spans it (uint8). The memory lives as
    long as the array or the window does (the anonymous map is Python's `mmap`), so a view kept
    after the batch never points at unmapped memory."""

    def __init__(self, nbytes: int):
        self.nbytes = (max(nbytes, PAGE) + PAGE - 1) // PAGE * PAGE
        self._anonymous = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._anonymous, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self._used = 0

    def clear(self) -> None:
        """Every mapped file dropped from the window (zero pages again): its files are let go."""
        if self._used:
            self._map(0, self._used, -1, 0, mmap.MAP_ANONYMOUS)
            self._used = 0

    def place(self, descriptor: int, offset: int, length: int) -> int:
        """Map `length` bytes of the open file from `offset` after what the window holds; where
        they begin in `array`. OSError when the kernel refuses (the caller's failed read)."""
        start = offset - offset % PAGE
        span = (offset - start + length + PAGE - 1) // PAGE * PAGE
        if self._used + span > self.nbytes:
            raise OSError(f"a window of {self.nbytes} bytes cannot hold {span} more")
        if span:
            self._map(self._used, span, descriptor, start, 0)
        at = self._used + offset - start
        self._used += span
        return at

    def _map(self, at: int, span: int, descriptor: int, offset: int, kind: int) -> None:
        address = _libc.mmap(self.address + at, span, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | MAP_FIXED | kind, descriptor, offset)
        if address == _MAP_FAILED:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    def release(self) -> None:
        """The files are let go now; the address space goes with the last reference to it."""
        self.clear()
