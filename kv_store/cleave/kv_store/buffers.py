"""Reusable host memory for the large transient buffers of a KV transfer: blocks exported
from the engine's pool, and values received from Redis.

A fresh buffer costs a page fault per 4 KiB page plus a zero-fill before anything can be
written into it: for a 2048-token prompt (45 MiB of blocks) that was 20 ms, more than the
transfer itself (and 16 of an export's 20 ms). Both instead use leases of memory the process
keeps.

A lease is a writable view; slices of it, and tensors made from them, keep it alive. Its
memory comes back to the cache when the last of them is gone, so a caller never releases
anything by hand, and memory still in use is never handed out twice.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import weakref

_ROUND = 1 << 20  # buffers come in whole MiB so that similar requests share them


class HostBuffers:
    """Leases of reusable memory; at most ``max_cached_bytes`` of it kept while unused."""

    def __init__(self, max_cached_bytes: int) -> None:
        if max_cached_bytes < 0:
            raise ValueError("max_cached_bytes must be >= 0")
        self.max_cached_bytes = max_cached_bytes
        self._free: list[bytearray] = []
        self._cached = 0
        self._lock = threading.Lock()
        # A lease ends in whatever thread drops its last view, and may end inside this class's
        # own critical section: a garbage collection started by an allocation under the lock
        # can free a view caught in a reference cycle. Such a return never waits for the lock
        # (that would deadlock) and never touches the free list (a sort may be running on it);
        # it goes here, and the next taker files it.
        self._returned: queue.SimpleQueue[bytearray] = queue.SimpleQueue()

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return self._cached

    def lease(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory (contents undefined)."""
        if nbytes <= 0:
            return memoryview(bytearray(0))
        buffer = self._take(nbytes)
        # The ctypes array is the lease's owner: every view made from the returned one refers
        # to it, and the finalizer runs when the last view goes.
        owner = (ctypes.c_char * nbytes).from_buffer(buffer)
        weakref.finalize(owner, self._give_back, buffer)
        return memoryview(owner).cast("B")

    def _take(self, nbytes: int) -> bytearray:
        size = -(-nbytes // _ROUND) * _ROUND
        with self._lock:
            self._file_returned()
            fitting = [b for b in self._free if len(b) >= nbytes]
            if fitting:
                best = min(fitting, key=len)
                self._free.remove(best)
                self._cached -= len(best)
                return best
            if size <= self.max_cached_bytes:
                # Room for the new buffer's eventual return: drop the smallest unused ones.
                self._free.sort(key=len)
                while self._free and self._cached + size > self.max_cached_bytes:
                    self._cached -= len(self._free.pop(0))
        return bytearray(size)

    def _file_returned(self) -> None:
        """Move returns that could not take the lock into the free list (lock held)."""
        while True:
            try:
                buffer = self._returned.get_nowait()
            except queue.Empty:
                return
            self._keep(buffer)

    def _keep(self, buffer: bytearray) -> None:
        if self._cached + len(buffer) <= self.max_cached_bytes:
            self._free.append(buffer)
            self._cached += len(buffer)

    def _give_back(self, buffer: bytearray) -> None:
        if not self._lock.acquire(blocking=False):
            self._returned.put(buffer)  # SimpleQueue.put is safe even from a finalizer
            return
        try:
            self._keep(buffer)
        finally:
            self._lock.release()
