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
        self._lock = threading.Lock()  # a lease can end in any thread

    @property
    def cached_bytes(self) -> int:
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
        with self._lock:
            fitting = [b for b in self._free if len(b) >= nbytes]
            if fitting:
                best = min(fitting, key=len)
                self._free.remove(best)
                self._cached -= len(best)
                return best
            # No fit: make room for the new buffer's eventual return by dropping small ones.
            size = -(-max(nbytes, 1) // _ROUND) * _ROUND
            self._free.sort(key=len)
            while self._free and self._cached + size > self.max_cached_bytes:
                self._cached -= len(self._free.pop(0))
        return bytearray(size)

    def _give_back(self, buffer: bytearray) -> None:
        with self._lock:
            if self._cached + len(buffer) <= self.max_cached_bytes:
                self._free.append(buffer)
                self._cached += len(buffer)
