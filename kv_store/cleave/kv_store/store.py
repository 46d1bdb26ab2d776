"""The block store contract, and an in-memory implementation for unit tests.

Every operation ends in a result, a miss, or one typed error (:class:`StoreUnavailable`):
callers fall back to recomputing, never hang and never see a half-trusted block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from cleave.kv_store.codec import BlockHeader, CorruptBlock, decode
from cleave.kv_store.keys import KeySpace

T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The store could not answer in time (down, paused, unreachable, overloaded)."""


@dataclass(frozen=True)
class EncodedBlock:
    """A block ready to store: its hash and its whole encoded value (see ``codec``).

    With ``seal``, the value's header is not written yet: a store calls :meth:`sealed_value`
    just before the value goes out (see ``codec.HeaderWriter.deferred``).
    """

    block_hash: bytes
    value: memoryview | bytes
    seal: Callable[[], None] | None = None

    def sealed_value(self) -> memoryview | bytes:
        if self.seal is not None:
            self.seal()
        return self.value

    @property
    def nbytes(self) -> int:
        return memoryview(self.value).nbytes


@dataclass(frozen=True)
class StoredBlock:
    header: BlockHeader
    payload: memoryview  # raw tensor bytes; zero-copy view into the value read

    @property
    def block_hash(self) -> bytes:
        return self.header.block_hash


class BlockStore(Protocol):
    keys: KeySpace

    async def put_many(self, blocks: Sequence[EncodedBlock]) -> int:
        """Store blocks (one atomic write each, with a TTL); returns how many were written."""

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        """Fetch blocks; a missing, evicted or corrupt block is ``None``."""

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a hash chain are present."""

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        """The longest run of leading blocks that exist and verify."""

    async def fetch_prefix_as(self, hashes: Sequence[bytes],
                              finish: Callable[[StoredBlock], T | None]) -> list[T]:
        """:meth:`fetch_prefix`, each block passed through ``finish`` as soon as it is in;
        one it makes None of ends the run."""

    async def delete_namespace(self) -> int:
        """Delete every block of this store's namespace; returns the number deleted."""

    async def problem(self) -> str | None:
        """Why the store cannot serve right now (never the password), or None."""

    async def close(self) -> None: ...


class MemoryBlockStore:
    """A dict with the store's semantics (encoding and verification included); tests only."""

    def __init__(self, keys: KeySpace) -> None:
        self.keys = keys
        self.values: dict[bytes, bytes] = {}
        self.corrupt_blocks = 0

    async def put_many(self, blocks: Sequence[EncodedBlock]) -> int:
        for b in blocks:
            self.values[self.keys.block_key(b.block_hash)] = bytes(b.sealed_value())
        return len(blocks)

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        found: list[StoredBlock | None] = []
        for h in hashes:
            value = self.values.get(self.keys.block_key(h))
            if value is None:
                found.append(None)
                continue
            try:
                header, payload = decode(value, expected_hash=h, key=self.keys.mac_key)
            except CorruptBlock:
                self.corrupt_blocks += 1
                found.append(None)
                continue
            found.append(StoredBlock(header, payload))
        return found

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if self.keys.block_key(h) not in self.values:
                break
            n += 1
        return n

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        prefix: list[StoredBlock] = []
        for block in await self.get_many(hashes[: await self.longest_cached_prefix(hashes)]):
            if block is None:
                break
            prefix.append(block)
        return prefix

    async def fetch_prefix_as(self, hashes: Sequence[bytes],
                              finish: Callable[[StoredBlock], T | None]) -> list[T]:
        out: list[T] = []
        for block in await self.fetch_prefix(hashes):
            item = finish(block)
            if item is None:
                break
            out.append(item)
        return out

    async def delete_namespace(self) -> int:
        prefix = self.keys.namespace_pattern()[:-1]
        doomed = [k for k in self.values if k.startswith(prefix)]
        for k in doomed:
            del self.values[k]
        return len(doomed)

    async def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        return None
