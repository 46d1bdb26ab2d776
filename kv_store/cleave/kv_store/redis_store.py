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

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cleave.kv_store import metrics
from cleave.kv_store.codec import CorruptBlock, decode
from cleave.kv_store.keys import KeySpace
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
    max_concurrency: int = 4  # pipelines in flight
    max_inflight_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.ttl_seconds < 1 or self.timeout_seconds <= 0:
            raise ValueError("ttl_seconds and timeout_seconds must be positive")
        if self.pipeline_depth < 1 or self.max_concurrency < 1 or self.max_inflight_bytes < 1:
            raise ValueError("pipeline_depth, max_concurrency, max_inflight_bytes must be >= 1")

    def __repr__(self) -> str:  # the password must never reach a log line
        return f"RedisStoreConfig(url={_redact(self.url)!r}, cluster={self.cluster})"


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def _client(config: RedisStoreConfig) -> Any:
    options: dict[str, Any] = {
        "socket_timeout": config.timeout_seconds,
        "socket_connect_timeout": config.connect_timeout_seconds,
        "retry": Retry(NoBackoff(), 0),
    }
    if config.password is not None:
        options["password"] = config.password
    if config.username is not None:
        options["username"] = config.username
    if config.url.startswith("rediss://"):
        options["ssl_ca_certs"] = config.tls_ca_file
        options["ssl_certfile"] = config.tls_cert_file
        options["ssl_keyfile"] = config.tls_key_file
        options["ssl_cert_reqs"] = "required" if config.tls_verify else "none"
    if config.cluster:
        return RedisCluster.from_url(config.url, **options)
    options["max_connections"] = config.max_concurrency + 2
    return aioredis.Redis.from_url(config.url, **options)


class RedisBlockStore:
    def __init__(self, keys: KeySpace, config: RedisStoreConfig) -> None:
        self.keys = keys
        self.config = config
        self._redis = _client(config)
        self._pipelines = asyncio.Semaphore(config.max_concurrency)

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
            results = await asyncio.gather(*(self._run_pipeline(fill(b))
                                             for b in self._batches(len(blocks), size)))
            return sum(1 for batch in results for ok in batch if ok is True)

        written = await self._bounded("put", work)
        metrics.STORE_BYTES_WRITTEN.inc(sum(b.nbytes for b in blocks))
        return written

    async def get_many(self, hashes: Sequence[bytes]) -> list[StoredBlock | None]:
        if not hashes:
            return []

        def fill(batch: range) -> Callable[[Any], None]:
            def go(pipe: Any) -> None:
                for i in batch:
                    pipe.get(self.keys.block_key(hashes[i]))
            return go

        async def work() -> list[Any]:
            batches = self._batches(len(hashes), 1 << 20)
            results = await asyncio.gather(*(self._run_pipeline(fill(b)) for b in batches))
            return [value for batch in results for value in batch]

        raw = await self._bounded("get", work)
        found: list[StoredBlock | None] = []
        for h, value in zip(hashes, raw, strict=True):
            if value is None:
                metrics.STORE_MISSES.inc()
                found.append(None)
                continue
            metrics.STORE_BYTES_READ.inc(len(value))
            try:
                header, payload = decode(value, expected_hash=h)
            except CorruptBlock:
                metrics.STORE_CORRUPT.inc()
                metrics.STORE_MISSES.inc()
                found.append(None)
                continue
            metrics.STORE_HITS.inc()
            found.append(StoredBlock(header, payload))
        return found

    async def longest_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0

        async def work() -> int:
            async with self._pipelines:
                pipe = self._redis.pipeline(transaction=False)
                for h in hashes:
                    pipe.exists(self.keys.block_key(h))
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

        A block present at lookup but gone at fetch was evicted in between: counted, and the
        prefix ends there, as it does at a corrupt block.
        """
        present = await self.longest_cached_prefix(hashes)
        blocks = await self.get_many(hashes[:present])
        prefix: list[StoredBlock] = []
        for block in blocks:
            if block is None:
                break
            prefix.append(block)
        evicted = sum(1 for b in blocks if b is None)
        if evicted:
            metrics.STORE_EVICTIONS.inc(evicted)
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
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:  # one key per command: keys of a cluster live in different slots
            pipe.unlink(k)
        return sum(int(n) for n in await pipe.execute())

    async def ping(self) -> bool:
        try:
            return bool(await self._bounded("ping", self._redis.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._redis.aclose()
