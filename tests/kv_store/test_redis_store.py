"""The Redis block store against real redis-server processes: single node, AUTH, faults, cluster.

Each call must end in data, a miss, or StoreUnavailable within its timeout: the faults below
kill, pause or never start a server and time every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import redis
import torch
from prometheus_client import REGISTRY
from redis.cluster import RedisCluster as SyncRedisCluster
from redis_servers import AUTH_PASSWORD, RedisClusterServers, RedisServer, closed_port

from cleave.kv_store.block_hash import KVFingerprint, chain_hashes
from cleave.kv_store.codec import BlockHeader, encode, encode_into, header_size
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_store import RedisBlockStore, RedisStoreConfig
from cleave.kv_store.store import EncodedBlock, StoredBlock, StoreUnavailable

TIMEOUT = 0.5
SLACK = 0.5
BLOCK = 16
SHAPE = (2, 2, 2, BLOCK, 8)  # layers, k/v, kv heads, tokens, head dim: 8 KiB of bf16
REAL_SHAPE = (30, 2, 3, BLOCK, 64)  # SmolLM2-135M's layout: 720 KiB of bf16 per block
FP = KVFingerprint("SmolLM2-135M-Instruct", "sha256:0123", "bfloat16", num_layers=30,
                   num_kv_heads=3, head_dim=64, block_size=BLOCK, salt="tests")
FP_OTHER = KVFingerprint("SmolLM2-135M-Instruct", "sha256:0123", "bfloat16", num_layers=30,
                         num_kv_heads=3, head_dim=64, block_size=BLOCK, salt="other-tenant")

MakeStore = Callable[..., RedisBlockStore]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


def errors(op: str) -> float:
    return metric("cleave_kv_store_errors_total", op=op)


def bf16_payload(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def make_blocks(n: int, *, seed: int = 0, shape: tuple[int, ...] = SHAPE,
                fp: KVFingerprint = FP) -> tuple[list[EncodedBlock], list[torch.Tensor]]:
    """``n`` chained blocks of a prompt, each a real bf16 KV tensor encoded as stored."""
    tokens = [(seed * 7919 + i) % 49152 for i in range(n * BLOCK + 5)]  # + a partial block
    hashes = chain_hashes(fp.root_hash(), tokens, BLOCK)
    assert len(hashes) == n
    blocks, tensors = [], []
    for i, h in enumerate(hashes):
        t = bf16_payload(shape, seed * 1000 + i)
        payload = memoryview(t.contiguous().view(torch.uint8).numpy())
        blocks.append(EncodedBlock(h, encode(BlockHeader("bfloat16", shape, BLOCK, h), payload)))
        tensors.append(t)
    return blocks, tensors


def same_bits(stored: StoredBlock, t: torch.Tensor) -> bool:
    back = torch.frombuffer(bytearray(stored.payload), dtype=torch.bfloat16)
    return torch.equal(back.view(stored.header.shape).view(torch.int16), t.view(torch.int16))


def unique_namespace(tag: str = "t") -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def make_store() -> AsyncIterator[MakeStore]:
    stores: list[RedisBlockStore] = []

    def make(url: str, *, namespace: str | None = None, fp: KVFingerprint = FP,
             **config: Any) -> RedisBlockStore:
        config.setdefault("timeout_seconds", TIMEOUT)
        config.setdefault("connect_timeout_seconds", TIMEOUT)
        keys = KeySpace(namespace or unique_namespace(), fp.root_hash())
        store = RedisBlockStore(keys, RedisStoreConfig(url=url, **config))
        stores.append(store)
        return store

    yield make
    for store in stores:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.close(), 5)


@pytest.fixture(scope="module")
def plain(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client()


async def expect_unavailable(call: Callable[[], Any], limit: float = TIMEOUT + SLACK
                             ) -> float:
    start = time.perf_counter()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(call(), limit + 5)  # the outer bound only catches a hang
    elapsed = time.perf_counter() - start
    assert elapsed <= limit, f"StoreUnavailable after {elapsed:.2f} s, allowed {limit} s"
    return elapsed


# --- single node: data path ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_put_get_round_trip(redis_server: RedisServer, make_store: MakeStore,
                                  transport: str) -> None:
    url = redis_server.url if transport == "tcp" else redis_server.unix_url
    store = make_store(url)
    blocks, tensors = make_blocks(6, seed=1)
    hits, misses = metric("cleave_kv_store_hits_total"), metric("cleave_kv_store_misses_total")
    written = metric("cleave_kv_store_written_bytes_total")
    assert await store.put_many(blocks) == 6
    assert metric("cleave_kv_store_written_bytes_total") - written == sum(
        b.nbytes for b in blocks)
    missing = chain_hashes(FP.root_hash(), [1, 2, 3] * BLOCK, BLOCK)[0]
    got = await store.get_many([b.block_hash for b in blocks] + [missing])
    assert got[-1] is None
    for stored, block, t in zip(got[:-1], blocks, tensors, strict=True):
        assert stored is not None
        assert stored.block_hash == block.block_hash
        assert stored.header == BlockHeader("bfloat16", SHAPE, BLOCK, block.block_hash)
        assert same_bits(stored, t)
    assert metric("cleave_kv_store_hits_total") - hits == 6
    assert metric("cleave_kv_store_misses_total") - misses == 1
    assert await store.ping()


async def test_unix_socket_and_tcp_see_the_same_blocks(redis_server: RedisServer,
                                                       make_store: MakeStore) -> None:
    ns = unique_namespace()
    over_unix = make_store(redis_server.unix_url, namespace=ns)
    over_tcp = make_store(redis_server.url, namespace=ns)
    blocks, tensors = make_blocks(3, seed=2)
    assert await over_unix.put_many(blocks) == 3
    got = await over_tcp.get_many([b.block_hash for b in blocks])
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))


async def test_realistic_blocks_round_trip_bit_exactly(redis_server: RedisServer,
                                                       make_store: MakeStore) -> None:
    store = make_store(redis_server.unix_url, timeout_seconds=5.0)
    blocks, tensors = make_blocks(4, seed=3, shape=REAL_SHAPE)
    assert blocks[0].nbytes == header_size(5) + 30 * 2 * 3 * 16 * 64 * 2
    assert await store.put_many(blocks) == 4
    got = await store.get_many([b.block_hash for b in blocks])
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))


async def test_memoryview_values_written_in_place_are_stored(redis_server: RedisServer,
                                                             make_store: MakeStore) -> None:
    """The producer's zero-copy path: payload laid in a buffer, header by encode_into."""
    store = make_store(redis_server.url)
    hashes = chain_hashes(FP.root_hash(), list(range(3 * BLOCK)), BLOCK)
    blocks, tensors = [], []
    for i, h in enumerate(hashes):
        t = bf16_payload(SHAPE, 40 + i)
        header = BlockHeader("bfloat16", SHAPE, BLOCK, h)
        start = header_size(len(SHAPE))
        buf = bytearray(start + header.payload_len)
        buf[start:] = t.view(torch.uint8).numpy().tobytes()
        encode_into(memoryview(buf), header)
        blocks.append(EncodedBlock(h, memoryview(buf)))
        tensors.append(t)
    assert await store.put_many(blocks) == 3
    got = await store.get_many(hashes)
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))


async def test_many_small_pipelines_keep_order(redis_server: RedisServer,
                                               make_store: MakeStore) -> None:
    store = make_store(redis_server.url, pipeline_depth=4, max_concurrency=2,
                       max_inflight_bytes=64 << 10)
    blocks, tensors = make_blocks(40, seed=4)
    assert await store.put_many(blocks) == 40
    absent = chain_hashes(FP.root_hash(), [9] * (5 * BLOCK), BLOCK)
    wanted = [h for pair in zip([b.block_hash for b in reversed(blocks)], absent * 8,
                                strict=True) for h in pair]
    got = await store.get_many(wanted)
    assert len(got) == 80
    for i, stored in enumerate(got):
        if i % 2:
            assert stored is None
        else:
            assert stored is not None and same_bits(stored, tensors[39 - i // 2])


async def test_a_database_index_in_the_url_is_used_by_every_operation(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(f"redis://127.0.0.1:{redis_server.port}/3")
    blocks, _ = make_blocks(3, seed=19)
    hashes = [b.block_hash for b in blocks]
    assert await store.put_many(blocks) == 3
    db0, db3 = redis_server.client(db=0), redis_server.client(db=3)
    try:
        keys = [store.keys.block_key(h) for h in hashes]
        assert db0.exists(*keys) == 0
        assert db3.exists(*keys) == 3
        assert await store.longest_cached_prefix(hashes) == 3
        assert await store.delete_namespace() == 3
        assert db3.exists(*keys) == 0
    finally:
        db0.close()
        db3.close()


async def test_empty_calls_need_no_server(make_store: MakeStore) -> None:
    store = make_store(f"redis://127.0.0.1:{closed_port()}/0")
    assert await store.put_many([]) == 0
    assert await store.get_many([]) == []
    assert await store.longest_cached_prefix([]) == 0


async def test_every_key_has_a_ttl_within_the_configured_one(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url, ttl_seconds=120)
    blocks, _ = make_blocks(5, seed=5)
    await store.put_many(blocks)
    keys = [store.keys.block_key(b.block_hash) for b in blocks]
    assert sorted(plain.scan_iter(match=store.keys.namespace_pattern())) == sorted(keys)
    for key in keys:
        assert 0 < plain.ttl(key) <= 120
        assert 0 < plain.pttl(key) <= 120_000


async def test_a_rewrite_refreshes_the_ttl(redis_server: RedisServer, make_store: MakeStore,
                                           plain: redis.Redis) -> None:
    store = make_store(redis_server.url, ttl_seconds=300)
    blocks, _ = make_blocks(1, seed=6)
    await store.put_many(blocks)
    key = store.keys.block_key(blocks[0].block_hash)
    plain.expire(key, 5)
    await store.put_many(blocks)
    assert plain.ttl(key) > 5


async def test_longest_cached_prefix_stops_at_the_first_missing_block(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(8, seed=7)
    hashes = [b.block_hash for b in blocks]
    assert await store.longest_cached_prefix(hashes) == 0
    await store.put_many(blocks[:3] + blocks[4:])  # block 3 never written
    assert await store.longest_cached_prefix(hashes) == 3
    assert await store.longest_cached_prefix(hashes[:2]) == 2
    assert await store.longest_cached_prefix(hashes[4:]) == 4
    await store.put_many([blocks[3]])
    assert await store.longest_cached_prefix(hashes) == 8
    plain.delete(store.keys.block_key(hashes[0]))
    assert await store.longest_cached_prefix(hashes) == 0


async def test_fetch_prefix_returns_the_verified_leading_blocks(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(redis_server.url)
    blocks, tensors = make_blocks(6, seed=8)
    await store.put_many(blocks[:4])
    prefix = await store.fetch_prefix([b.block_hash for b in blocks])
    assert [s.block_hash for s in prefix] == [b.block_hash for b in blocks[:4]]
    assert all(same_bits(s, t) for s, t in zip(prefix, tensors, strict=False))


async def test_block_evicted_between_lookup_and_fetch_ends_the_prefix(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(6, seed=9)
    hashes = [b.block_hash for b in blocks]
    await store.put_many(blocks)
    real_get_raw = store._get_raw  # the fetch step after the EXISTS lookup

    async def get_after_an_eviction(wanted: Sequence[bytes]) -> list[object]:
        assert list(wanted) == hashes  # the lookup found all six
        plain.delete(store.keys.block_key(hashes[2]))  # evicted in between
        return await real_get_raw(wanted)

    monkeypatch.setattr(store, "_get_raw", get_after_an_eviction)
    evictions = metric("cleave_kv_store_evictions_noticed_total")
    corrupt = metric("cleave_kv_store_corrupt_blocks_total")
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes[:2]
    assert metric("cleave_kv_store_evictions_noticed_total") - evictions == 1
    assert metric("cleave_kv_store_corrupt_blocks_total") - corrupt == 0


def _corrupt(plain: redis.Redis, key: bytes, kind: str, other_value: bytes) -> None:
    value: bytes = plain.get(key)  # type: ignore[assignment]
    payload_at = header_size(len(SHAPE))
    if kind == "payload-byte":
        pos = payload_at + 1234
        plain.setrange(key, pos, bytes([value[pos] ^ 0x10]))
    elif kind == "header-byte":
        plain.setrange(key, 10, bytes([value[10] ^ 0x01]))  # the token count
    elif kind == "last-byte":
        plain.setrange(key, len(value) - 1, bytes([value[-1] ^ 0x80]))
    elif kind == "truncated":
        plain.set(key, value[:-100], keepttl=True)
    elif kind == "appended":
        plain.append(key, b"\x00")
    elif kind == "another-blocks-value":
        plain.set(key, other_value, keepttl=True)
    elif kind == "garbage":
        plain.set(key, b"not a KV block", keepttl=True)
    else:
        raise AssertionError(kind)


CORRUPTIONS = ["payload-byte", "header-byte", "last-byte", "truncated", "appended",
               "another-blocks-value", "garbage"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
async def test_a_corrupted_stored_value_is_a_miss(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis,
        kind: str) -> None:
    store = make_store(redis_server.url)
    blocks, tensors = make_blocks(4, seed=10)
    await store.put_many(blocks)
    hashes = [b.block_hash for b in blocks]
    _corrupt(plain, store.keys.block_key(hashes[1]), kind, bytes(blocks[0].value))
    corrupt, misses = (metric("cleave_kv_store_corrupt_blocks_total"),
                       metric("cleave_kv_store_misses_total"))
    got = await store.get_many(hashes)
    assert got[1] is None
    assert all(s is not None and same_bits(s, t)
               for s, t in zip(got[::2] + got[3:], tensors[::2] + tensors[3:], strict=True))
    assert metric("cleave_kv_store_corrupt_blocks_total") - corrupt == 1
    assert metric("cleave_kv_store_misses_total") - misses == 1


async def test_fetch_prefix_ends_at_a_corrupt_block_without_calling_it_an_eviction(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(5, seed=11)
    await store.put_many(blocks)
    hashes = [b.block_hash for b in blocks]
    _corrupt(plain, store.keys.block_key(hashes[3]), "payload-byte", b"")
    corrupt = metric("cleave_kv_store_corrupt_blocks_total")
    evictions = metric("cleave_kv_store_evictions_noticed_total")
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes[:3]
    assert metric("cleave_kv_store_corrupt_blocks_total") - corrupt == 1
    # The block was present at lookup and still present at fetch: nothing was evicted.
    assert metric("cleave_kv_store_evictions_noticed_total") - evictions == 0


async def test_delete_namespace_removes_only_its_own_keys(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    base = unique_namespace("d")
    mine = make_store(redis_server.url, namespace=base)
    mine_other_fp = make_store(redis_server.url, namespace=base, fp=FP_OTHER)
    neighbours = [make_store(redis_server.url, namespace=ns)
                  for ns in (f"{base}-2", f"{base}x", f"{base}.y", base[:-1])]
    mine_blocks, _ = make_blocks(7, seed=12)
    other_fp_blocks, _ = make_blocks(3, seed=12, fp=FP_OTHER)
    neighbour_blocks, neighbour_tensors = make_blocks(2, seed=12)  # the same hashes
    await mine.put_many(mine_blocks)
    await mine_other_fp.put_many(other_fp_blocks)
    for store in neighbours:
        await store.put_many(neighbour_blocks)
    plain.set(b"unrelated:" + base.encode(), b"keep me")

    # The namespace pattern, run as a real SCAN, lists exactly this namespace's keys.
    expected = {mine.keys.block_key(b.block_hash) for b in mine_blocks} | {
        mine_other_fp.keys.block_key(b.block_hash) for b in other_fp_blocks}
    assert set(plain.scan_iter(match=mine.keys.namespace_pattern(), count=100)) == expected

    assert await mine.delete_namespace() == 10
    assert await mine.longest_cached_prefix([b.block_hash for b in mine_blocks]) == 0
    assert not list(plain.scan_iter(match=mine.keys.namespace_pattern(), count=100))
    for store in neighbours:
        got = await store.get_many([b.block_hash for b in neighbour_blocks])
        assert all(s is not None and same_bits(s, t)
                   for s, t in zip(got, neighbour_tensors, strict=True)), store.keys.namespace
    assert plain.get(b"unrelated:" + base.encode()) == b"keep me"
    assert await mine.delete_namespace() == 0


async def test_delete_namespace_handles_more_keys_than_one_batch(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(redis_server.url, timeout_seconds=5.0)
    hashes = chain_hashes(FP.root_hash(), list(range(1100 * 2)), 2)
    tiny = [EncodedBlock(h, encode(BlockHeader("float16", (2,), 2, h), bytes(4)))
            for h in hashes]
    assert await store.put_many(tiny) == 1100
    assert await store.delete_namespace() == 1100


# --- AUTH and secrets ----------------------------------------------------------------------


async def test_auth_with_the_right_password(auth_redis_server: RedisServer,
                                            make_store: MakeStore) -> None:
    s = auth_redis_server
    stores = [make_store(s.url, password=AUTH_PASSWORD),
              make_store(f"redis://:{AUTH_PASSWORD}@127.0.0.1:{s.port}/0"),
              make_store(s.unix_url, password=AUTH_PASSWORD)]
    blocks, tensors = make_blocks(2, seed=13)
    for store in stores:
        assert await store.ping()
        assert await store.put_many(blocks) == 2
        got = await store.get_many([b.block_hash for b in blocks])
        assert all(x is not None and same_bits(x, t) for x, t in zip(got, tensors, strict=True))
        assert await store.delete_namespace() == 2


@pytest.mark.parametrize("password", [None, "wrong-password"])
async def test_auth_failure_is_unavailable_not_a_hang(
        auth_redis_server: RedisServer, make_store: MakeStore, password: str | None) -> None:
    store = make_store(auth_redis_server.url, password=password)
    blocks, _ = make_blocks(2, seed=14)
    hashes = [b.block_hash for b in blocks]
    before = {op: errors(op) for op in ("put", "get", "lookup", "delete")}
    for op, call in [("put", lambda: store.put_many(blocks)),
                     ("get", lambda: store.get_many(hashes)),
                     ("lookup", lambda: store.longest_cached_prefix(hashes)),
                     ("delete", store.delete_namespace)]:
        start = time.perf_counter()
        with pytest.raises(StoreUnavailable) as info:
            await call()
        assert time.perf_counter() - start <= TIMEOUT + SLACK
        assert AUTH_PASSWORD not in str(info.value)
        if password:
            assert password not in str(info.value)
        assert errors(op) - before[op] == 1, op
    assert not await store.ping()


async def test_config_password_overrides_one_in_the_url(auth_redis_server: RedisServer,
                                                         make_store: MakeStore) -> None:
    """RedisStoreConfig documents ``password`` as overriding a password in the URL."""
    s = auth_redis_server
    store = make_store(f"redis://:stale-password@127.0.0.1:{s.port}/0", password=AUTH_PASSWORD)
    blocks, _ = make_blocks(1, seed=15)
    hashes = [blocks[0].block_hash]
    assert await store.put_many(blocks) == 1
    assert (await store.get_many(hashes))[0] is not None
    assert await store.longest_cached_prefix(hashes) == 1
    assert await store.ping()  # every operation, not only the bulk ones
    assert await store.delete_namespace() == 1


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0",
    f"redis://:{AUTH_PASSWORD}@127.0.0.1:6379/0",
    f"redis://svc-user:{AUTH_PASSWORD}@redis.example:6379/0",
    f"rediss://default:{AUTH_PASSWORD}@redis.example:6380",
    f"unix://:{AUTH_PASSWORD}@/tmp/redis.sock?db=0",
    f"redis://:{AUTH_PASSWORD}@@127.0.0.1:6379/0",
])
def test_repr_never_shows_the_password(url: str) -> None:
    config = RedisStoreConfig(url=url, password=AUTH_PASSWORD, username="svc-user")
    for text in (repr(config), str(config), f"{config}", f"{config!r}"):
        assert AUTH_PASSWORD not in text
    if "@" in url:
        assert "***" in repr(config)
    store = RedisBlockStore(KeySpace("svc", FP.root_hash()), config)
    assert AUTH_PASSWORD not in repr(store)


def test_repr_never_shows_a_password_given_as_a_url_query_parameter() -> None:
    # redis-py reads ?password=... from the URL just like the userinfo part.
    config = RedisStoreConfig(url=f"redis://127.0.0.1:6379/0?password={AUTH_PASSWORD}")
    assert AUTH_PASSWORD not in repr(config)


# --- faults: each test has a server of its own -----------------------------------------


async def test_killed_server_is_unavailable_quickly(fresh_redis_server: RedisServer,
                                                    make_store: MakeStore) -> None:
    store = make_store(fresh_redis_server.url)
    blocks, _ = make_blocks(3, seed=16)
    hashes = [b.block_hash for b in blocks]
    assert await store.put_many(blocks) == 3  # pooled connections are open
    fresh_redis_server.kill()
    before = {op: errors(op) for op in ("put", "get", "lookup", "delete")}
    await expect_unavailable(lambda: store.put_many(blocks))
    await expect_unavailable(lambda: store.get_many(hashes))
    await expect_unavailable(lambda: store.longest_cached_prefix(hashes))
    await expect_unavailable(lambda: store.fetch_prefix(hashes))
    await expect_unavailable(store.delete_namespace)
    assert errors("put") - before["put"] == 1
    assert errors("get") - before["get"] == 1
    assert errors("lookup") - before["lookup"] == 2
    assert errors("delete") - before["delete"] == 1
    start = time.perf_counter()
    assert not await store.ping()
    assert time.perf_counter() - start <= TIMEOUT + SLACK


async def test_paused_server_times_out_then_the_same_store_recovers(
        fresh_redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(fresh_redis_server.url)
    blocks, tensors = make_blocks(4, seed=17)
    hashes = [b.block_hash for b in blocks]
    assert await store.put_many(blocks[:2]) == 2
    fresh_redis_server.pause()
    try:
        before = {op: errors(op) for op in ("put", "get", "lookup")}
        for call in (lambda: store.put_many(blocks[2:]), lambda: store.get_many(hashes),
                     lambda: store.longest_cached_prefix(hashes)):
            elapsed = await expect_unavailable(call)
            assert elapsed >= TIMEOUT * 0.8  # it waited for its timeout, not less
        assert all(errors(op) - before[op] == 1 for op in before)
    finally:
        fresh_redis_server.resume()
    assert await store.ping()
    assert await store.put_many(blocks) == 4
    got = await store.get_many(hashes)
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))
    assert await store.longest_cached_prefix(hashes) == 4


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_server_never_started_is_unavailable(make_store: MakeStore, tmp_path: Any,
                                                   transport: str) -> None:
    url = (f"redis://127.0.0.1:{closed_port()}/0" if transport == "tcp"
           else f"unix://{tmp_path}/absent.sock?db=0")
    store = make_store(url)
    blocks, _ = make_blocks(2, seed=18)
    before = errors("put")
    await expect_unavailable(lambda: store.put_many(blocks))
    await expect_unavailable(lambda: store.get_many([b.block_hash for b in blocks]))
    await expect_unavailable(lambda: store.longest_cached_prefix([blocks[0].block_hash]))
    await expect_unavailable(store.delete_namespace)
    assert errors("put") - before == 1
    assert not await store.ping()


def _big_blocks(n: int, size: int) -> list[EncodedBlock]:
    payload = os.urandom(size)
    hashes = chain_hashes(FP.root_hash(), list(range(n * BLOCK)), BLOCK)
    shape = (size // 2 // (BLOCK * 64), BLOCK, 64)
    return [EncodedBlock(h, encode(BlockHeader("bfloat16", shape, BLOCK, h), payload))
            for h in hashes]


@pytest.mark.parametrize("op", ["put", "get"])
async def test_kill_mid_operation_ends_in_unavailable_or_a_result(
        fresh_redis_server: RedisServer, make_store: MakeStore, op: str) -> None:
    timeout = 5.0
    store = make_store(fresh_redis_server.unix_url, timeout_seconds=timeout)
    blocks = _big_blocks(200, 256 << 10)
    hashes = [b.block_hash for b in blocks]
    if op == "get":
        assert await store.put_many(blocks) == 200
    before = errors(op)
    start = time.perf_counter()
    task = asyncio.create_task(store.put_many(blocks) if op == "put"
                               else store.get_many(hashes))
    await asyncio.sleep(0.005)
    fresh_redis_server.kill()
    done, _ = await asyncio.wait([task], timeout=timeout + SLACK)
    assert done, "the operation hung after the server died"
    elapsed = time.perf_counter() - start
    assert elapsed <= timeout + SLACK
    if isinstance(task.exception(), StoreUnavailable):
        assert errors(op) - before == 1
    else:
        result = task.result()
        if op == "put":
            assert isinstance(result, int) and 0 <= result <= 200
        else:
            assert len(result) == 200
            for stored, h in zip(result, hashes, strict=True):
                assert stored is None or stored.block_hash == h
    await expect_unavailable(lambda: store.get_many(hashes[:1]), timeout + SLACK)


# --- Redis Cluster -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_client(redis_cluster: RedisClusterServers) -> SyncRedisCluster:
    node = redis_cluster.nodes[0]
    return SyncRedisCluster(host="127.0.0.1", port=node.port, socket_timeout=5)


def _per_node_keys(cluster: RedisClusterServers, pattern: bytes) -> list[set[bytes]]:
    found = []
    for node in cluster.nodes:
        client = node.client()
        try:
            found.append(set(client.scan_iter(match=pattern, count=1000)))
        finally:
            client.close()
    return found


async def test_cluster_spreads_blocks_over_slots_and_nodes(
        redis_cluster: RedisClusterServers, cluster_client: SyncRedisCluster,
        make_store: MakeStore) -> None:
    store = make_store(redis_cluster.url, cluster=True, timeout_seconds=5.0, ttl_seconds=600)
    blocks, tensors = make_blocks(24, seed=20)
    hashes = [b.block_hash for b in blocks]
    assert await store.put_many(blocks) == 24
    keys = [store.keys.block_key(h) for h in hashes]
    slots = {cluster_client.keyslot(k) for k in keys}
    assert len(slots) > 1
    per_node = _per_node_keys(redis_cluster, store.keys.namespace_pattern())
    assert sum(1 for found in per_node if found) >= 2, [len(f) for f in per_node]
    assert set().union(*per_node) == set(keys)
    assert all(0 < cluster_client.ttl(k) <= 600 for k in keys)

    got = await store.get_many(hashes)
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))
    assert await store.longest_cached_prefix(hashes) == 24
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes

    cluster_client.delete(keys[10])
    assert await store.longest_cached_prefix(hashes) == 10
    assert [s.block_hash for s in await store.fetch_prefix(hashes)] == hashes[:10]


async def test_cluster_delete_namespace_reaches_every_node(
        redis_cluster: RedisClusterServers, make_store: MakeStore) -> None:
    base = unique_namespace("c")
    mine = make_store(redis_cluster.url, namespace=base, cluster=True, timeout_seconds=5.0)
    neighbour = make_store(redis_cluster.url, namespace=f"{base}-2", cluster=True,
                           timeout_seconds=5.0)
    blocks, tensors = make_blocks(30, seed=21)
    assert await mine.put_many(blocks) == 30
    assert await neighbour.put_many(blocks[:6]) == 6
    assert sum(1 for f in _per_node_keys(redis_cluster, mine.keys.namespace_pattern()) if f) >= 2
    assert await mine.delete_namespace() == 30
    assert not set().union(*_per_node_keys(redis_cluster, mine.keys.namespace_pattern()))
    assert await mine.get_many([b.block_hash for b in blocks]) == [None] * 30
    got = await neighbour.get_many([b.block_hash for b in blocks[:6]])
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=False))


async def test_cluster_corrupt_value_is_a_miss(redis_cluster: RedisClusterServers,
                                               cluster_client: SyncRedisCluster,
                                               make_store: MakeStore) -> None:
    store = make_store(redis_cluster.url, cluster=True, timeout_seconds=5.0)
    blocks, _ = make_blocks(3, seed=22)
    await store.put_many(blocks)
    key = store.keys.block_key(blocks[1].block_hash)
    pos = header_size(len(SHAPE)) + 7
    cluster_client.setrange(key, pos, bytes([cluster_client.getrange(key, pos, pos)[0] ^ 1]))
    corrupt = metric("cleave_kv_store_corrupt_blocks_total")
    got = await store.get_many([b.block_hash for b in blocks])
    assert got[0] is not None and got[1] is None and got[2] is not None
    assert metric("cleave_kv_store_corrupt_blocks_total") - corrupt == 1
