"""The block store on Redis (single node over TCP or a unix socket, or Redis Cluster).

Each block is one ``SET key value EX ttl``: atomic, self-describing (see ``codec``), expiring.
Writes and reads are pipelined, with a bound on pipelines and bytes in flight; every call is
bounded by a timeout and ends in data, a miss, or :class:`StoreUnavailable`. No retries inside:
the caller's fallback (recompute) is cheaper than waiting on a sick store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis.exceptions import RedisError

from cleave.kv_store import metrics
from cleave.kv_store.buffers import HostBuffers
from cleave.kv_store.codec import CorruptBlock, decode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig, redis_py_client
from cleave.kv_store.resp import Endpoint, RespConnection, RespPool
from cleave.kv_store.store import EncodedBlock, StoredBlock, StoreUnavailable
from cleave.kv_store.transfer import TransferLimits, get_many_into, set_many

T = TypeVar("T")


_UNKNOWN_VALUE_BYTES = 1 << 20  # batches reads of unknown sizes as if values were this big


@dataclass(frozen=True)
class _Read:
    nbytes: int | None  # None: no value under the key
    block: StoredBlock | None  # None with nbytes: the value is corrupt
    finished: object = None  # what fetch_prefix_as's ``finish`` made of the block, if given


def _check(block_hash: bytes, value: Any,
           finish: Callable[[StoredBlock], object] | None = None, key: bytes = b"") -> _Read:
    if value is None:
        return _Read(None, None)
    try:
        header, payload = decode(value, expected_hash=block_hash, key=key)
    except CorruptBlock:
        return _Read(len(value), None)
    block = StoredBlock(header, payload)
    return _Read(len(value), block, finish(block) if finish is not None else None)


def _same(block: StoredBlock) -> StoredBlock:
    return block


class _Tally:
    """One call's store metrics, published at once (not a metric update per block)."""

    def __init__(self) -> None:
        self.hits = self.misses = self.corrupt = self.evictions = self.bytes_read = 0

    def block(self, read: _Read) -> StoredBlock | None:
        """The read's block, or None (a miss: absent, or corrupt), counted."""
        if read.nbytes is None:
            self.misses += 1
            return None
        self.bytes_read += read.nbytes
        if read.block is None:
            self.corrupt += 1
            self.misses += 1
            return None
        self.hits += 1
        return read.block

    def publish(self) -> None:
        for counter, n in ((metrics.STORE_HITS, self.hits), (metrics.STORE_MISSES, self.misses),
                           (metrics.STORE_CORRUPT, self.corrupt),
                           (metrics.STORE_EVICTIONS, self.evictions),
                           (metrics.STORE_BYTES_READ, self.bytes_read)):
            if n:
                counter.inc(n)


class RedisBlockStore:
    def __init__(self, keys: KeySpace, config: RedisStoreConfig) -> None:
        self.keys = keys
        self.config = config
        self._redis = redis_py_client(config)
        self._pipelines = asyncio.Semaphore(config.connections)
        self._put_limits = TransferLimits(config.connections, config.pipeline_depth,
                                          config.put_bytes)
        self._get_limits = TransferLimits(config.connections, config.pipeline_depth,
                                          config.get_bytes_in_flight)
        # Bulk SET/GET/STRLEN of one node go through the lean RESP path (see resp.py);
        # a cluster (slot routing) and TLS stay on redis-py.
        self._bulk: RespPool | None = None
        self._buffers = HostBuffers(config.read_buffer_cache_bytes)
        self._value_bytes: int | None = None  # the length of the values seen so far
        if not config.cluster and config.url.split("://")[0] in ("redis", "unix"):
            # Twice one transfer's connections: two transfers at once both run at full width.
            self._bulk = RespPool(
                Endpoint.from_url(config.url, config.username, config.password),
                2 * config.connections, config.timeout_seconds,
                config.connect_timeout_seconds, config.splice_sends)

    async def _bounded(self, op: str, work: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(work(), self.config.timeout_seconds)
        except (TimeoutError, RedisError, OSError) as e:
            metrics.STORE_ERRORS.labels(op).inc()
            raise StoreUnavailable(f"KV store {op} failed: {type(e).__name__}: {e}") from None
        finally:
            metrics.STORE_OP_SECONDS.labels(op).observe(time.perf_counter() - start)

    def _batches(self, sizes: Sequence[int]) -> list[range]:
        """Consecutive runs of values, each within the pipeline's depth and byte bounds."""
        batches: list[range] = []
        start, nbytes = 0, 0
        for i, size in enumerate(sizes):
            if i > start and (i - start >= self.config.pipeline_depth
                              or nbytes + size > self.config.pipeline_bytes):
                batches.append(range(start, i))
                start, nbytes = i, 0
            nbytes += size
        if sizes:
            batches.append(range(start, len(sizes)))
        return batches

    async def _run_pipeline(self, fill: Callable[[Any], None]) -> list[Any]:
        async with self._pipelines:
            pipe = self._redis.pipeline(transaction=False)
            fill(pipe)
            return list(await pipe.execute())

    async def put_many(self, blocks: Sequence[EncodedBlock]) -> int:
        if not blocks:
            return 0
        ttl = self.config.ttl_seconds

        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    # One SET per block: header and payload land together or not at all. The
                    # memoryview goes to the socket writer as is (redis-py does not copy it).
                    b = blocks[i]
                    pipe.set(self.keys.block_key(b.block_hash), b.sealed_value(), ex=ttl)
            return go

        async def work() -> int:
            if self._bulk is not None:
                items = [(self.keys.block_key(b.block_hash), b.value) for b in blocks]
                return await asyncio.to_thread(set_many, self._bulk, items, ttl, self._put_limits,
                                               [b.seal for b in blocks])
            batches = self._batches([b.nbytes for b in blocks])
            results = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
            return sum(1 for batch in results for ok in batch if ok is True)

        written = await self._bounded("put", work)
        self._value_bytes = blocks[-1].nbytes
        metrics.STORE_BYTES_WRITTEN.inc(sum(b.nbytes for b in blocks))
        return written

    async def _read(self, hashes: Sequence[bytes],
                    finish: Callable[[StoredBlock], object] | None = None) -> list[_Read]:
        """Each hash's value, fetched and checked.

        On the fast path replies are received in place at the length values have had so far
        (a store's blocks are all one model's, one size); a miss or a value of another length
        is read the ordinary way. Each value is checked in its reading thread the moment it
        is in, while still in cache (that took the checksum from 15% of a fetch to nothing
        measurable). Every read renews the block's TTL (GETEX), so the blocks of a prefix in
        use expire together, after their last use, never the early ones first.
        """
        ttl = self.config.ttl_seconds
        mac = self.keys.mac_key  # each value's MAC is checked with it (codec.decode)
        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    pipe.getex(self.keys.block_key(hashes[i]), ex=ttl)
            return go

        async def work() -> list[_Read]:
            guess = self._value_bytes
            if self._bulk is not None:
                keys = [self.keys.block_key(h) for h in hashes]
                # No length known yet: the transfer asks STRLEN first.
                sizes = [guess] * len(keys) if guess else None
                reads = await asyncio.to_thread(
                    get_many_into, self._bulk, keys, self._buffers, sizes,
                    lambda i, value: _check(hashes[i], value, finish, mac),
                    self._get_limits, ttl)
            else:
                batches = self._batches([guess or _UNKNOWN_VALUE_BYTES] * len(hashes))
                raw = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
                reads = [_check(h, v, finish, mac) for b, values in zip(batches, raw, strict=True)
                         for h, v in zip(hashes[b.start:b.stop], values, strict=True)]
            # Learnt from verified blocks only: a stray value must not set the expected size.
            self._value_bytes = next((r.nbytes for r in reads if r.block is not None), guess)
            return reads

        return await self._bounded("get", work)

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        if not hashes:
            return []
        tally = _Tally()
        found = [tally.block(r) for r in await self._read(hashes)]
        tally.publish()
        return found

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks are present (STRLEN: one small round trip, no values)."""
        if not hashes:
            return 0

        async def work() -> int:
            keys = [self.keys.block_key(h) for h in hashes]
            if self._bulk is not None:
                sizes = await asyncio.to_thread(self._bulk.run, RespConnection.strlen_many,
                                                keys)
            else:
                def fill(pipe: Any) -> None:
                    for k in keys:
                        pipe.strlen(k)
                sizes = [int(n) for n in await self._run_pipeline(fill)]
            return next((i for i, n in enumerate(sizes) if n <= 0), len(sizes))

        return await self._bounded("lookup", work)

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        return await self.fetch_prefix_as(hashes, _same)

    async def fetch_prefix_as(self, hashes: Sequence[bytes],
                              finish: Callable[[StoredBlock], T | None]) -> list[T]:
        """What ``finish`` makes of the longest run of leading blocks that exist *and*
        verify; a block it makes None of ends the run (a layout the caller cannot use).

        ``finish`` runs on each block the moment it is verified, in the transfer's thread on
        the fast path, so its work overlaps the wait for the blocks after it.

        One round of GETs with no lookup before it: a missing block costs a five-byte reply,
        and the lookup's round trip was a tenth of a 2048-token fetch. A missing block with a
        present one after it is a hole the store made (a chain's blocks are written in order
        and each read renews every block it returns, so they age together: it lost one to
        eviction or expiry): counted as an eviction and a miss. A corrupt block also ends the
        prefix; a chain that simply ends counts nothing. Bytes read count the prefix's blocks
        (and a corrupt one that ended it), not what was fetched past the end.
        """
        if not hashes:
            return []
        reads = await self._read(hashes, finish)
        tally = _Tally()
        prefix: list[T] = []
        for i, read in enumerate(reads):
            if read.nbytes is None:
                if any(later.nbytes is not None for later in reads[i + 1:]):
                    tally.evictions += 1
                    tally.misses += 1
                break
            if tally.block(read) is None or read.finished is None:
                break
            prefix.append(cast(T, read.finished))
        tally.publish()
        return prefix

    async def delete_namespace(self) -> int:
        async def work() -> int:
            deleted = 0
            batch: list[bytes] = []
            async for key in self._redis.scan_iter(match=self.keys.namespace_pattern(),
                                                   count=1000):
                batch.append(key)
                if len(batch) >= 512:
                    deleted += await self._unlink(batch)
                    batch = []
            if batch:
                deleted += await self._unlink(batch)
            return deleted

        return await self._bounded("delete", work)

    async def _unlink(self, keys: list[bytes]) -> int:
        # One key per command: a cluster's keys live in different slots.
        if self.config.cluster:
            return sum(await asyncio.gather(*(self._redis.unlink(k) for k in keys)))
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.unlink(k)
        return sum(int(n) for n in await pipe.execute())

    async def problem(self) -> str | None:
        """Why the store cannot serve right now (down, refusing the password, ...), or None.

        The reason names the error, never the password, so probes and logs may show it.
        """
        try:
            await self._bounded("ping", self._redis.ping)
        except StoreUnavailable as e:
            return str(e)
        return None

    async def ping(self) -> bool:
        return await self.problem() is None

    async def close(self) -> None:
        if self._bulk is not None:
            self._bulk.close()
        await self._redis.aclose()
