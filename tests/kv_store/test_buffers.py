"""Receive buffers: leased memory comes back only when every view of it is gone."""

from __future__ import annotations

import ctypes
import gc
import threading

import torch

from cleave.kv_store.buffers import HostBuffers

MiB = 1 << 20


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_lease_is_writable_memory_of_the_asked_size() -> None:
    view = HostBuffers(8 * MiB).lease(1000)
    assert view.nbytes == 1000 and not view.readonly and view.format == "B"
    view[:] = b"x" * 1000
    assert bytes(view[:3]) == b"xxx"


def test_memory_is_reused_once_the_last_view_is_gone() -> None:
    buffers = HostBuffers(8 * MiB)
    first = buffers.lease(3 * MiB)
    where = address(first)
    del first
    assert buffers.cached_bytes == 3 * MiB
    second = buffers.lease(2 * MiB)  # the cached buffer is big enough
    assert address(second) == where
    assert buffers.cached_bytes == 0


def test_memory_a_slice_or_tensor_still_uses_is_never_handed_out_again() -> None:
    buffers = HostBuffers(8 * MiB)
    lease = buffers.lease(MiB)
    lease[:4] = b"\x01\x02\x03\x04"
    tensor = torch.frombuffer(lease[:4], dtype=torch.uint8)
    where = address(lease)
    del lease
    gc.collect()
    other = buffers.lease(MiB)
    assert address(other) != where  # the tensor's memory stays its own
    other[:4] = b"\x00\x00\x00\x00"
    assert tensor.tolist() == [1, 2, 3, 4]
    del tensor
    assert buffers.cached_bytes == MiB  # now it is back


def test_unused_memory_kept_stays_under_the_cap() -> None:
    buffers = HostBuffers(3 * MiB)
    leases = [buffers.lease(MiB) for _ in range(5)]
    del leases
    assert buffers.cached_bytes == 3 * MiB  # two of the five were let go
    big = buffers.lease(3 * MiB - 100)  # fits the cap: small cached ones are dropped for it
    del big
    assert buffers.cached_bytes == 3 * MiB
    huge = buffers.lease(5 * MiB)  # over the cap: never cached
    del huge
    assert buffers.cached_bytes == 3 * MiB  # what was cached stays; the huge one is not


def test_a_lease_can_end_in_another_thread() -> None:
    buffers = HostBuffers(8 * MiB)
    leases = [buffers.lease(MiB) for _ in range(4)]
    thread = threading.Thread(target=leases.clear)
    thread.start()
    thread.join()
    assert buffers.cached_bytes == 4 * MiB


def test_zero_bytes_is_an_empty_view() -> None:
    assert HostBuffers(MiB).lease(0).nbytes == 0


def test_a_lease_ending_inside_the_pools_own_lock_neither_deadlocks_nor_is_lost() -> None:
    # A garbage collection started by an allocation under the lock can end a lease whose last
    # view was in a reference cycle: its return runs in the lock holder's own thread.
    buffers = HostBuffers(8 * MiB)
    lease = buffers.lease(MiB)
    with buffers._lock:
        del lease  # the finalizer runs here, in this thread, with the lock held
    assert buffers.cached_bytes == MiB
    again = buffers.lease(MiB)
    assert buffers.cached_bytes == 0 and again.nbytes == MiB


def test_a_lease_bigger_than_the_cap_keeps_the_cache() -> None:
    buffers = HostBuffers(4 * MiB)
    small = buffers.lease(MiB)
    del small
    huge = buffers.lease(16 * MiB)  # never cachable: no reason to drop what is kept
    assert buffers.cached_bytes == MiB
    del huge
    assert buffers.cached_bytes == MiB
