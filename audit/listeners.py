"""A Mooncake client's handshake listener, made to see its stop at once: close() without a second's wait.

Every Mooncake client (the store's, and a bare TransferEngine) accepts handshakes on a thread that
blocks in accept() with a one-second receive timeout, and its close() joins that thread
(`SocketHandShakePlugin`, Mooncake `transfer_metadata_plugin.cpp`). So close() waits for the
current second of that accept to end: up to 1 s on every process, however little it did
(docs/benchmarks.md). `accept_shortened` gives the blocking listening sockets a client's setup
opened a timeout of `ACCEPT_TIMEOUT_S`, and wakes the accept already waiting with a connection that
sends nothing (the listener reads no request from it and accepts again). close() then takes
milliseconds; handshakes are accepted as before, and the teardown is Mooncake's own.

Linux only (/proc); a socket that cannot be found or changed is left as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Iterator

ACCEPT_TIMEOUT_S = 0.05  # the listener wakes 20 times a second; close() waits at most this long
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def _listening_inodes() -> set[str]:
    """The inodes of the TCP sockets in this network namespace that listen."""
    inodes: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and fields[3] == _TCP_LISTEN:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def blocking_listeners() -> set[tuple[int, str]]:
    """(fd, inode) of this process's listening TCP sockets that block (no O_NONBLOCK): an event
    loop's listener never blocks in accept(), so it is never one of them."""
    listening = _listening_inodes()
    found: set[tuple[int, str]] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        if inode in listening:
            try:
                if not fcntl.fcntl(int(name), fcntl.F_GETFL) & os.O_NONBLOCK:
                    found.add((int(name), inode))
            except OSError:
                continue
    return found


def _shorten(fd: int) -> None:
    try:
        with socket.socket(fileno=os.dup(fd)) as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                struct.pack("ll", 0, int(ACCEPT_TIMEOUT_S * 1_000_000)))
            host, port = listener.getsockname()[:2]
            family = listener.family
    except OSError:
        return
    if host in ("0.0.0.0", "::"):
        host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    try:  # the accept() already waiting still has its second: end it now
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return  # that accept() ends within its second; every later one within ACCEPT_TIMEOUT_S


@contextlib.contextmanager
def accept_shortened() -> Iterator[None]:
    """Around a Mooncake client's setup: the blocking listeners it opens see their stop within
    `ACCEPT_TIMEOUT_S`, so its close() does not wait out a second."""
    before = blocking_listeners()
    yield
    for fd, _ in blocking_listeners() - before:
        _shorten(fd)
