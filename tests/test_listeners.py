"""The Mooncake clients' handshake listeners, shortened (audit.listeners): on a real master and
holder, the listener a client's setup opens gets the short accept timeout, no other socket is
touched, and close() still withdraws the client's metadata."""

from __future__ import annotations

import os
import socket
import struct
import urllib.error
import urllib.parse
import urllib.request

import pytest

from audit.connection import open_store
from audit.listeners import ACCEPT_TIMEOUT_S, blocking_listeners
from audit.readers.engine import RawTransfer


def _accept_timeout_s(fd: int) -> float:
    with socket.socket(fileno=os.dup(fd)) as listener:
        seconds, microseconds = struct.unpack("ll", listener.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                                                        struct.calcsize("ll")))
    return seconds + microseconds / 1e6


def _metadata_status(settings, name: str) -> int:
    url = f"{settings.metadata}?key={urllib.parse.quote(name, safe='')}"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture
def own_listener():
    """A blocking listener of this process opened before the client: it must be left alone."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener


def test_the_store_clients_listener_is_shortened_and_close_still_withdraws_its_metadata(settings, own_listener):
    before = blocking_listeners()
    assert (own_listener.fileno(), os.readlink(f"/proc/self/fd/{own_listener.fileno()}")[8:-1]) in before
    store = open_store(settings)
    try:
        opened = blocking_listeners() - before
        assert len(opened) == 1  # the handshake daemon's; the transport's event-loop listener never blocks
        (fd, _), = opened
        assert _accept_timeout_s(fd) == pytest.approx(ACCEPT_TIMEOUT_S, abs=0.01)  # in jiffies; Mooncake sets 1 s
        assert _accept_timeout_s(own_listener.fileno()) == 0.0
        with socket.socket(fileno=os.dup(fd)) as listener:
            port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it still accepts
        name = store.get_hostname()
        assert _metadata_status(settings, f"mooncake/ram/{name}") == 200
    finally:
        store.close()
    assert _metadata_status(settings, f"mooncake/ram/{name}") == 404
    assert _metadata_status(settings, f"mooncake/rpc_meta/{name}") == 404
    assert blocking_listeners() == before


def test_a_transfer_engines_listener_is_shortened(settings, own_listener):
    before = blocking_listeners()
    transfer = RawTransfer(settings)
    try:
        opened = blocking_listeners() - before
        assert len(opened) == 1
        (fd, _), = opened
        assert _accept_timeout_s(fd) == pytest.approx(ACCEPT_TIMEOUT_S, abs=0.01)  # in jiffies; Mooncake sets 1 s
        assert _accept_timeout_s(own_listener.fileno()) == 0.0
    finally:
        transfer.close()
    assert blocking_listeners() == before
