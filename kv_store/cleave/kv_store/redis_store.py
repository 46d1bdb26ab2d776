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
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cleave.kv_store import metrics
from cleave.kv_store.buffers import HostBuffers
from cleave.kv_store.codec import CorruptBlock, decode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.resp import Endpoint, RespConnection, RespPool
from cleave.kv_store.store import EncodedBlock, StoredBlock, StoreUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class RedisStoreConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS) or unix:///path.sock
    password: str | None = None  # overrides one in the URL; never logged
    username: str | None = None
    cluster: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    ttl_seconds: int = 3600
    timeout_seconds: float = 2.0  # per call: lookups, a whole put_many, a whole get_many
    connect_timeout_seconds: float = 1.0
    pipeline_depth: int = 32  # commands per pipeline, at most
    # Value bytes per pipeline, at most (one value always goes). Deeper pipelines of large
    # values made Redis itself slower here: 2.6 GB/s at 12 MiB against 5.5 at 4 MiB.
    pipeline_bytes: int = 4 << 20
    max_concurrency: int = 2  # pipelines (connections) in flight; Redis serves one at a time
    # Values are ~64 KiB-1 MiB: reading the socket in 1 MiB gulps instead of redis-py's
    # 64 KiB default cuts event-loop round trips per value.
    socket_read_size: int = 1 << 20
    # Memory kept for reuse by reads once their blocks are loaded (see buffers.py).
    read_buffer_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.ttl_seconds < 1 or self.timeout_seconds <= 0:
            raise ValueError("ttl_seconds and timeout_seconds must be positive")
        if self.pipeline_depth < 1 or self.max_concurrency < 1 or self.pipeline_bytes < 1:
            raise ValueError("pipeline_depth, pipeline_bytes and max_concurrency must be >= 1")

    def __repr__(self) -> str:  # the password must never reach a log line
        return f"RedisStoreConfig(url={_redact(self.url)!r}, cluster={self.cluster})"


def _redact(url: str) -> str:
    """The URL with any password (user info or ``?password=``) replaced by ``***``."""
    u = urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(("password=***" if p.lower().startswith("password=") else p)
                     for p in u.query.split("&")) if u.query else ""
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def _without_password(url: str) -> str:
    """Drop the URL's own password so the configured one wins (redis-py lets the URL win)."""
    u = urlsplit(url)
    netloc = u.netloc.rpartition("@")[2]
    user = u.netloc.rpartition("@")[0].partition(":")[0] if "@" in u.netloc else ""
    if user:
        netloc = f"{user}@{netloc}"
    query = "&".join(p for p in u.query.split("&") if not p.lower().startswith("password="))
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def _client(config: RedisStoreConfig) -> Any:
    options: dict[str, Any] = {
        "socket_timeout": config.timeout_seconds,
        "socket_connect_timeout": config.connect_timeout_seconds,
        "retry": Retry(NoBackoff(), 0),
        "socket_read_size": config.socket_read_size,
    }
    url = config.url
    if config.password is not None:
        options["password"] = config.password
        url = _without_password(url)
    if config.username is not None:
        options["username"] = config.username
    if config.url.startswith("rediss://"):
        options["ssl_ca_certs"] = config.tls_ca_file
        options["ssl_certfile"] = config.tls_cert_file
        options["ssl_keyfile"] = config.tls_key_file
        options["ssl_cert_reqs"] = "required" if config.tls_verify else "none"
    if config.cluster:
        return RedisCluster.from_url(url, **options)
    options["max_connections"] = config.max_concurrency + 2
    return aioredis.Redis.from_url(url, **options)


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
        self._redis = _client(config)
        self._pipelines = asyncio.Semaphore(config.max_concurrency)
        # Bulk SET/GET/STRLEN of one node go through the lean RESP path (see resp.py);
        # a cluster (slot routing) and TLS stay on redis-py.
        self._bulk: RespPool | None = None
        self._buffers = HostBuffers(config.read_buffer_cache_bytes)
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
        metrics.STORE_BYTES_WRITTEN.inc(sum(b.nbytes for b in blocks))
        return written

    async def _read(self, hashes: Sequence[bytes],
                    sizes: Sequence[int] | None = None) -> list[_Read]:
        """Each hash's value, fetched and checked. On the fast path each value is checked in
        its reading thread as soon as it is in, while it is still in cache (this took the
        checksum's cost from 15% of a fetch to nothing measurable). ``sizes`` are the
        values' lengths from a lookup; without them each pipeline asks for them first."""

        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    pipe.get(self.keys.block_key(hashes[i]))
            return go

        async def work() -> list[_Read]:
            batches = self._batches(sizes or [_UNKNOWN_VALUE_BYTES] * len(hashes))
            if self._bulk is not None:
                bulk, buffers = self._bulk, self._buffers

                def read(batch: range) -> list[_Read]:
                    part = hashes[batch.start:batch.stop]
                    keys = [self.keys.block_key(h) for h in part]
                    known = sizes[batch.start:batch.stop] if sizes else None
                    return bulk.run(RespConnection.get_many_into, keys, buffers, known,
                                    lambda i, value: _check(part[i], value))

                results = await asyncio.gather(*(asyncio.to_thread(read, b) for b in batches))
            else:
                raw = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
                results = [[_check(h, v) for h, v in zip(hashes[b.start:b.stop], values,
                                                          strict=True)]
                           for b, values in zip(batches, raw, strict=True)]
            return [r for batch in results for r in batch]

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

    async def _leading_sizes(self, hashes: Sequence[bytes]) -> list[int]:
        """The lengths of the values of the chain's leading present blocks (STRLEN)."""
        async def work() -> list[int]:
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
            present = next((i for i, n in enumerate(sizes) if n <= 0), len(sizes))
            return sizes[:present]

        return await self._bounded("lookup", work)

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        return len(await self._leading_sizes(hashes)) if hashes else 0

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        """The longest run of leading blocks that exist *and* verify.

        A block present at lookup but gone at fetch was evicted (or expired) in between:
        counted, and the prefix ends there, as it does at a corrupt block.
        """
        sizes = await self._leading_sizes(hashes) if hashes else []
        if not sizes:
            return []
        prefix: list[StoredBlock] = []
        for read in await self._read(hashes[:len(sizes)], sizes):
            if read.nbytes is None:
                metrics.STORE_EVICTIONS.inc()
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
