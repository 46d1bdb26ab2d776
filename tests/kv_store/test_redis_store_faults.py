"""The Redis block store when things go wrong: corrupted values, AUTH and secrets, and servers
that are killed, paused or never started.

Each call must end in data, a miss, or StoreUnavailable within its timeout: the faults below
kill, pause or never start a server and time every call.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import redis
from redis_servers import AUTH_PASSWORD, RedisServer, closed_port
from redis_store_support import (
    BLOCK,
    FAULT_TIMEOUTS,
    FP,
    SHAPE,
    SLACK,
    TIMEOUT,
    MakeStore,
    StoreCounts,
    errors,
    expect_unavailable,
    make_blocks,
    same_bits,
)

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, encode, header_size
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import EncodedBlock, StoreUnavailable

# --- corrupted values ----------------------------------------------------------------------

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
    counts = StoreCounts()
    got = await store.get_many(hashes)
    assert got[1] is None
    assert all(s is not None and same_bits(s, t)
               for s, t in zip(got[::2] + got[3:], tensors[::2] + tensors[3:], strict=True))
    assert counts.moved("corrupt_blocks", "misses") == (1, 1)


async def test_fetch_prefix_ends_at_a_corrupt_block_without_calling_it_an_eviction(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(5, seed=11)
    await store.put_many(blocks)
    hashes = [b.block_hash for b in blocks]
    _corrupt(plain, store.keys.block_key(hashes[3]), "payload-byte", b"")
    counts = StoreCounts()
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes[:3]
    # A corrupt block is not a hole in the chain: nothing was evicted.
    assert counts.moved("corrupt_blocks", "evictions_noticed") == (1, 0)


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
    store = make_store(auth_redis_server.url, password=password, **FAULT_TIMEOUTS)
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
    store = make_store(fresh_redis_server.url, **FAULT_TIMEOUTS)
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
    assert errors("get") - before["get"] == 2  # get_many and fetch_prefix (no lookup)
    assert errors("lookup") - before["lookup"] == 1
    assert errors("delete") - before["delete"] == 1
    start = time.perf_counter()
    assert not await store.ping()
    assert time.perf_counter() - start <= TIMEOUT + SLACK


async def test_paused_server_times_out_then_the_same_store_recovers(
        fresh_redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(fresh_redis_server.url, **FAULT_TIMEOUTS)
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
    store = make_store(url, **FAULT_TIMEOUTS)
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
    store = make_store(fresh_redis_server.unix_url, timeout_seconds=timeout,
                       connect_timeout_seconds=TIMEOUT)
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
            # A put that returns rather than raises finished before the kill: every block
            # written (a partial write must be StoreUnavailable, never a short count).
            assert result == 200
        else:
            assert len(result) == 200
            for stored, h in zip(result, hashes, strict=True):
                assert stored is None or stored.block_hash == h
    await expect_unavailable(lambda: store.get_many(hashes[:1]), timeout + SLACK)


def test_fast_path_takes_credentials_from_the_url_query_too() -> None:
    from cleave.kv_store.resp import Endpoint

    ep = Endpoint.from_url("redis://cache:6380/2?password=s%40cret&username=svc")
    assert (ep.host, ep.port, ep.db, ep.username, ep.password) == ("cache", 6380, 2, "svc",
                                                                   "s@cret")
    assert Endpoint.from_url("redis://:pw@h/0", password="override").password == "override"
    # Read as redis-py reads it, escapes decoded once, so both paths send the same password.
    assert Endpoint.from_url("redis://:p%2541@h/0").password == "p%41"
    assert Endpoint.from_url("unix:///tmp/r.sock?db=3&username=u%40x").username == "u@x"
    assert Endpoint.from_url("unix:///tmp/r.sock?db=3").unix_path == "/tmp/r.sock"


@pytest.mark.parametrize(("url", "bare", "password"), [
    ("redis://:s%40cret@h:6379/0", "redis://h:6379/0", "s@cret"),
    ("redis://svc:pw@h/0", "redis://svc@h/0", "pw"),  # an ACL user's name stays
    ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0", "pw"),
    ("redis://h/0", "redis://h/0", None),
])
def test_a_password_comes_out_of_the_url_whole(url: str, bare: str, password: str | None
                                                ) -> None:
    # cleave up passes it to its children in the environment: no command line may show it.
    from cleave.kv_store.redis_config import split_password

    assert split_password(url) == (bare, password)
