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
from typing import Any, TypeVar

from redis.exceptions import RedisError

from cleave.kv_store import metrics
from cleave.kv_store.buffers import HostBuffers
from cleave.kv_store.codec import CorruptBlock, decode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig, redis_py_client
from cleave.kv_store.resp import Endpoint, RespConnection, RespPool
from cleave.kv_store.store import EncodedBlock, StoredBlock, StoreUnavailable

T = TypeVar("T")


_UNKNOWN_VALUE_BYTES = 1 << 20  # batches reads of unknown sizes as if values were this big


@dataclass(frozen=True)
class _Read:
    nbytes: int | None  # None: no value under the key
    block: StoredBlock | None  # None with nbytes: the value is corrupt


def _check(block_hash: bytes, value: Any) -> _Read:
    if value is None:
        return _Read(None, None)
    try:
        header, payload = decode(value, expected_hash=block_hash)
    except CorruptBlock:
        return _Read(len(value), None)
    return _Read(len(value), StoredBlock(header, payload))


class RedisBlockStore:
    def __init__(self, keys: KeySpace, config: RedisStoreConfig) -> None:
        self.keys = keys
        self.config = config
        self._redis = redis_py_client(config)
        self._pipelines = asyncio.Semaphore(config.max_concurrency)
        # Bulk SET/GET/STRLEN of one node go through the lean RESP path (see resp.py);
        # a cluster (slot routing) and TLS stay on redis-py.
        self._bulk: RespPool | None = None
        self._buffers = HostBuffers(config.read_buffer_cache_bytes)
        self._value_bytes: int | None = None  # the length of the values seen so far
        if not config.cluster and config.url.split("://")[0] in ("redis", "unix"):
            self._bulk = RespPool(
                Endpoint.from_url(config.url, config.username, config.password),
                config.max_concurrency, config.timeout_seconds, config.connect_timeout_seconds)

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
                    pipe.set(self.keys.block_key(b.block_hash), b.value, ex=ttl)
            return go

        async def work() -> int:
            batches = self._batches([b.nbytes for b in blocks])
            if self._bulk is not None:
                bulk = self._bulk
                counts = await asyncio.gather(*(asyncio.to_thread(
                    bulk.run, RespConnection.set_many,
                    [(self.keys.block_key(blocks[i].block_hash), blocks[i].value) for i in b],
                    ttl) for b in batches))
                return sum(counts)
            results = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
            return sum(1 for batch in results for ok in batch if ok is True)

        written = await self._bounded("put", work)
        self._value_bytes = blocks[-1].nbytes
        metrics.STORE_BYTES_WRITTEN.inc(sum(b.nbytes for b in blocks))
        return written

    async def _read(self, hashes: Sequence[bytes]) -> list[_Read]:
        """Each hash's value, fetched and checked.

        On the fast path replies are received in place at the length values have had so far
        (a store's blocks are all one model's, one size); a miss or a value of another length
        is read the ordinary way. Each value is checked in its reading thread the moment it
        is in, while still in cache (that took the checksum from 15% of a fetch to nothing
        measurable). Every read renews the block's TTL (GETEX), so the blocks of a prefix in
        use expire together, after their last use, never the early ones first.
        """
        ttl = self.config.ttl_seconds
        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    pipe.getex(self.keys.block_key(hashes[i]), ex=ttl)
            return go

        async def work() -> list[_Read]:
            guess = self._value_bytes
            batches = self._batches([guess or _UNKNOWN_VALUE_BYTES] * len(hashes))
            if self._bulk is not None:
                bulk, buffers = self._bulk, self._buffers

                def read(batch: range) -> list[_Read]:
                    part = hashes[batch.start:batch.stop]
                    keys = [self.keys.block_key(h) for h in part]
                    # No length known yet: the pipeline asks STRLEN first.
                    sizes = [guess] * len(part) if guess else None
                    return bulk.run(RespConnection.get_many_into, keys, buffers, sizes,
                                    lambda i, value: _check(part[i], value), ttl)

                results = await asyncio.gather(*(asyncio.to_thread(read, b) for b in batches))
            else:
                raw = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
                results = [[_check(h, v) for h, v in zip(hashes[b.start:b.stop], values,
                                                          strict=True)]
                           for b, values in zip(batches, raw, strict=True)]
            reads = [r for batch in results for r in batch]
            self._value_bytes = next((r.nbytes for r in reads if r.nbytes), guess)
            return reads

        return await self._bounded("get", work)

    @staticmethod
    def _count(read: _Read) -> StoredBlock | None:
        if read.nbytes is None:
            metrics.STORE_MISSES.inc()
            return None
        metrics.STORE_BYTES_READ.inc(read.nbytes)
        if read.block is None:
            metrics.STORE_CORRUPT.inc()
            metrics.STORE_MISSES.inc()
            return None
        metrics.STORE_HITS.inc()
        return read.block

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        if not hashes:
            return []
        return [self._count(r) for r in await self._read(hashes)]

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
                async with self._pipelines:
                    pipe = self._redis.pipeline(transaction=False)
                    for k in keys:
                        pipe.strlen(k)
                    sizes = [int(n) for n in await pipe.execute()]
            return next((i for i, n in enumerate(sizes) if n <= 0), len(sizes))

        return await self._bounded("lookup", work)

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        """The longest run of leading blocks that exist *and* verify.

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
        reads = await self._read(hashes)
        prefix: list[StoredBlock] = []
        for i, read in enumerate(reads):
            if read.nbytes is None:
                if any(later.nbytes is not None for later in reads[i + 1:]):
                    metrics.STORE_EVICTIONS.inc()
                    metrics.STORE_MISSES.inc()
                break
            block = self._count(read)
            if block is None:
                break
            prefix.append(block)
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
