"""Host memory touched ahead (audit.readers.buffers.HostMemoryAhead), registered with a real store
client: the buffers are made in it where it holds them (a smaller one borrows it, and gives it back
when released), in new memory where not."""

from __future__ import annotations

import numpy as np
import pytest

from audit.connection import open_store
from audit.readers.buffers import HostMemoryAhead, RegisteredBuffer


@pytest.fixture
def store(settings):
    """A real store client to register the buffers with."""
    client = open_store(settings)
    yield client
    client.close()


def test_buffers_of_the_sizes_foreseen_take_the_memory_touched_ahead(store):
    ahead = HostMemoryAhead([1 << 20, 1 << 20])
    ahead._thread.join()
    touched = [array.ctypes.data for array in ahead._arrays]
    first, second = ahead.registered(store, 1 << 20), ahead.registered(store, 1 << 20)
    assert isinstance(first, RegisteredBuffer) and [first.address, second.address] == touched
    assert first.nbytes == second.nbytes == 1 << 20 and not first.array.any()
    third = ahead.registered(store, 1 << 20)  # none left: new memory
    assert third.address not in touched and third.nbytes == 1 << 20
    for buffer in (first, second, third):
        buffer.release()


def test_a_size_not_foreseen_gets_new_memory_and_the_memory_ahead_is_dropped(store):
    ahead = HostMemoryAhead([1 << 20, 1 << 20])
    buffer = ahead.registered(store, 3 << 19)
    assert buffer.nbytes == 3 << 19 and isinstance(buffer.array, np.ndarray)
    assert ahead._arrays == []  # never held twice
    buffer.release()


def test_a_smaller_buffer_borrows_the_memory_ahead_and_gives_it_back_when_released(store):
    ahead = HostMemoryAhead([1 << 20, 2 << 20])
    ahead._thread.join()
    small, large = (array.ctypes.data for array in ahead._arrays)
    borrowed = ahead.registered(store, 4096)  # the samples' reader: the smallest memory that holds it
    assert borrowed.address == small and borrowed.nbytes == 4096
    borrowed.array[:] = 7
    borrowed.release()
    first, second = ahead.registered(store, 1 << 20), ahead.registered(store, 2 << 20)  # then the scan's
    assert (first.address, second.address) == (small, large) and first.nbytes == 1 << 20
    first.release()
    second.release()
