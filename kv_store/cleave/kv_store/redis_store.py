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
    pipeline_depth: int = 32  # commands per pipeline
    max_concurrency: int = 2  # pipelines (connections) in flight; Redis serves one at a time
    max_inflight_bytes: int = 64 << 20
    # Values are ~64 KiB-1 MiB: reading the socket in 1 MiB gulps instead of redis-py's
    # 64 KiB default cuts event-loop round trips per value.
    socket_read_size: int = 1 << 20

    def __post_init__(self) -> None:
        if self.ttl_seconds < 1 or self.timeout_seconds <= 0:
            raise ValueError("ttl_seconds and timeout_seconds must be positive")
        if self.pipeline_depth < 1 or self.max_concurrency < 1 or self.max_inflight_bytes < 1:
            raise ValueError("pipeline_depth, max_concurrency, max_inflight_bytes must be >= 1")

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


class RedisBlockStore:
    def __init__(self, keys: KeySpace, config: RedisStoreConfig) -> None:
        self.keys = keys
        self.config = config
        self._redis = _client(config)
        self._pipelines = asyncio.Semaphore(config.max_concurrency)
        # Bulk SET/GET/EXISTS of one node go through the lean RESP path (see resp.py);
        # a cluster (slot routing) and TLS stay on redis-py.
        self._bulk: RespPool | None = None
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

    def _batches(self, count: int, value_bytes: int) -> list[range]:
        # Depth shrinks for big values so pipelines x depth x size stays under the byte bound.
        per_pipeline = self.config.max_inflight_bytes // self.config.max_concurrency
        depth = max(1, min(self.config.pipeline_depth, per_pipeline // max(value_bytes, 1)))
        return [range(i, min(i + depth, count)) for i in range(0, count, depth)]

    async def _run_pipeline(self, fill: Callable[[Any], None]) -> list[Any]:
        async with self._pipelines:
            pipe = self._redis.pipeline(transaction=False)
            fill(pipe)
            return list(await pipe.execute())

    async def put_many(self, blocks: Sequence[EncodedBlock]) -> int:
        if not blocks:
            return 0
        size = max(b.nbytes for b in blocks)
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
            batches = self._batches(len(blocks), size)
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

    async def _get_raw(self, hashes: Sequence[bytes]) -> list[Any]:
        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    pipe.get(self.keys.block_key(hashes[i]))
            return go

        async def work() -> list[Any]:
            batches = self._batches(len(hashes), 1 << 20)
            if self._bulk is not None:
                bulk = self._bulk
                results = await asyncio.gather(*(asyncio.to_thread(
                    bulk.run, RespConnection.get_many,
                    [self.keys.block_key(hashes[i]) for i in b]) for b in batches))
            else:
                results = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
            return [value for batch in results for value in batch]

        return await self._bounded("get", work)

    @staticmethod
    def _verify(h: bytes, value: Any) -> StoredBlock | None:
        if value is None:
            metrics.STORE_MISSES.inc()
            return None
        metrics.STORE_BYTES_READ.inc(len(value))
        try:
            header, payload = decode(value, expected_hash=h)
        except CorruptBlock:
            metrics.STORE_CORRUPT.inc()
            metrics.STORE_MISSES.inc()
            return None
        metrics.STORE_HITS.inc()
        return StoredBlock(header, payload)

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        if not hashes:
            return []
        raw = await self._get_raw(hashes)
        return [self._verify(h, value) for h, value in zip(hashes, raw, strict=True)]

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0

        async def work() -> int:
            keys = [self.keys.block_key(h) for h in hashes]
            if self._bulk is not None:
                present = await asyncio.to_thread(self._bulk.run, RespConnection.exists_many,
                                                  keys)
            else:
                async with self._pipelines:
                    pipe = self._redis.pipeline(transaction=False)
                    for k in keys:
                        pipe.exists(k)
                    present = await pipe.execute()
            n = 0
            for p in present:
                if not p:
                    break
                n += 1
            return n

        return await self._bounded("lookup", work)

    async def fetch_prefix(self, hashes: Sequence[bytes]) -> list[StoredBlock]:
        """The longest run of leading blocks that exist *and* verify.

        A block present at lookup but gone at fetch was evicted (or expired) in between:
        counted, and the prefix ends there, as it does at a corrupt block.
        """
        present = await self.longest_cached_prefix(hashes)
        if not present:
            return []
        raw = await self._get_raw(hashes[:present])
        prefix: list[StoredBlock] = []
        for h, value in zip(hashes, raw, strict=False):
            if value is None:
                metrics.STORE_EVICTIONS.inc()
            block = self._verify(h, value)
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
