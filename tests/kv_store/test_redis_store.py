"""The Redis block store against a real redis-server: round trips over TCP and a unix socket,
keys and TTLs, prefix lookups, namespaces and the metrics they count.

Helpers are in ``redis_store_support``; the servers and ``make_store`` in ``conftest.py``.
"""

from __future__ import annotations

import threading

import pytest
import redis
import torch
from redis_servers import RedisServer, closed_port
from redis_store_support import (
    BLOCK,
    FP,
    FP_OTHER,
    REAL_SHAPE,
    SHAPE,
    MakeStore,
    StoreCounts,
    bf16_payload,
    make_blocks,
    same_bits,
    unique_namespace,
)

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import BlockHeader, HeaderWriter, encode, header_size
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.store import EncodedBlock, StoredBlock

# --- single node: data path ---------------------------------------------------------------

@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_put_get_round_trip(redis_server: RedisServer, make_store: MakeStore,
                                  transport: str) -> None:
    url = redis_server.url if transport == "tcp" else redis_server.unix_url
    store = make_store(url)
    blocks, tensors = make_blocks(6, seed=1)
    counts = StoreCounts()
    assert await store.put_many(blocks) == 6
    assert counts.moved("written_bytes") == (sum(b.nbytes for b in blocks),)
    missing = chain_hashes(FP.root_hash(), [1, 2, 3] * BLOCK, BLOCK)[0]
    got = await store.get_many([b.block_hash for b in blocks] + [missing])
    assert got[-1] is None
    for stored, block, t in zip(got[:-1], blocks, tensors, strict=True):
        assert stored is not None
        assert stored.block_hash == block.block_hash
        assert stored.header == BlockHeader("bfloat16", SHAPE, BLOCK, block.block_hash)
        assert same_bits(stored, t)
    assert counts.moved("hits", "misses") == (6, 1)
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


@pytest.mark.parametrize("splice_sends", [True, False])
async def test_values_sealed_as_they_go_out_are_stored(redis_server: RedisServer,
                                                      make_store: MakeStore,
                                                      splice_sends: bool) -> None:
    """The producer's zero-copy path: payloads laid in writable buffers, each header written
    by the store just before its value goes out (spliced, or copied), as the engine saves."""
    store = make_store(redis_server.unix_url, splice_sends=splice_sends)
    shape = (8, 2, 2, BLOCK, 64)  # 64 KiB + the header: large enough to be spliced
    headers = HeaderWriter("bfloat16", shape, BLOCK)
    hashes = chain_hashes(FP.root_hash(), list(range(12 * BLOCK)), BLOCK)
    blocks, tensors, buffers = [], [], []
    for i, h in enumerate(hashes):
        t = bf16_payload(shape, 40 + i)
        buf = bytearray(headers.value_size)
        buf[headers.header_size:] = t.view(torch.uint8).numpy().tobytes()
        blocks.append(EncodedBlock(h, memoryview(buf), seal=headers.deferred(memoryview(buf), h)))
        tensors.append(t)
        buffers.append(buf)
    assert bytes(buffers[0][:4]) == bytes(4)  # no header until the store sends the value
    assert await store.put_many(blocks) == 12
    # Once put_many returns Redis has read every value: reusing the memory changes nothing.
    for buf in buffers:
        buf[:] = bytes(len(buf))
    got = await store.get_many(hashes)
    assert all(s is not None and same_bits(s, t) for s, t in zip(got, tensors, strict=True))


async def test_many_small_pipelines_keep_order(redis_server: RedisServer,
                                               make_store: MakeStore) -> None:
    # 8 KiB blocks: up to 4 commands in flight on each of 2 connections, 40 blocks.
    store = make_store(redis_server.url, pipeline_depth=4, connections=2,
                       put_bytes_in_flight=32 << 10, get_bytes_in_flight=24 << 10)
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


@pytest.mark.parametrize("fresh_reader", [False, True], ids=["sizes-known", "sizes-asked"])
async def test_a_read_renews_the_ttl_of_what_it_returns(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis,
        fresh_reader: bool) -> None:
    # A prefix in use must not expire early block first while its later blocks live on.
    writer = make_store(redis_server.url, ttl_seconds=300)
    blocks, _ = make_blocks(3, seed=7)
    await writer.put_many(blocks)
    reader = (make_store(redis_server.url, namespace=writer.keys.namespace, ttl_seconds=300)
              if fresh_reader else writer)
    keys = [writer.keys.block_key(b.block_hash) for b in blocks]
    for k in keys:
        plain.expire(k, 5)
    assert len(await reader.fetch_prefix([b.block_hash for b in blocks])) == 3
    assert all(plain.ttl(k) > 5 for k in keys)
    plain.expire(keys[0], 5)
    assert len(await reader.get_many([blocks[0].block_hash])) == 1
    assert plain.ttl(keys[0]) > 5


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


async def test_fetch_prefix_as_finishes_each_block_in_the_transfer_thread(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    """The caller's per-block work (the connector makes tensors) runs as each block comes in,
    off the event loop; a block it cannot use ends the prefix without counting as corrupt."""
    store = make_store(redis_server.unix_url)
    blocks, tensors = make_blocks(6, seed=12)
    hashes = [b.block_hash for b in blocks]
    await store.put_many(blocks)
    threads: set[str] = set()

    def finish(block: StoredBlock) -> tuple[bytes, bool] | None:
        threads.add(threading.current_thread().name)
        if block.block_hash == hashes[3]:
            return None  # say, a layout this caller cannot load
        return block.block_hash, same_bits(block, tensors[hashes.index(block.block_hash)])

    counts = StoreCounts()
    prefix = await store.fetch_prefix_as(hashes, finish)
    assert prefix == [(h, True) for h in hashes[:3]]
    assert threading.current_thread().name not in threads  # not the event loop's thread
    assert counts.moved("corrupt_blocks") == (0,)


async def test_a_hole_in_the_chain_ends_the_prefix_and_is_an_eviction(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(6, seed=9)
    hashes = [b.block_hash for b in blocks]
    await store.put_many(blocks)
    plain.delete(store.keys.block_key(hashes[2]))  # evicted: blocks 3-5 are still there
    counts = StoreCounts()
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes[:2]
    assert counts.moved("evictions_noticed", "misses", "corrupt_blocks") == (1, 1, 0)


async def test_a_chain_that_simply_ends_counts_no_miss(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(8, seed=11)
    hashes = [b.block_hash for b in blocks]
    await store.put_many(blocks[:5])  # the prompt goes on past what is cached
    counts = StoreCounts()
    assert [s.block_hash for s in await store.fetch_prefix(hashes)] == hashes[:5]
    assert counts.moved("hits", "misses", "evictions_noticed") == (5, 0, 0)


async def test_a_fresh_store_reads_before_it_has_seen_a_value(
        redis_server: RedisServer, make_store: MakeStore) -> None:
    # A decode worker's store reads blocks another process wrote: no length is known yet,
    # so its pipelines ask STRLEN first; after that it reads in place.
    writer = make_store(redis_server.url)
    reader = make_store(redis_server.url, namespace=writer.keys.namespace)
    blocks, tensors = make_blocks(5, seed=12)
    await writer.put_many(blocks)
    for _ in range(2):
        got = await reader.fetch_prefix([b.block_hash for b in blocks])
        assert all(same_bits(s, t) for s, t in zip(got, tensors, strict=True))
        assert len(got) == 5


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


async def test_a_value_of_another_length_is_read_and_checked(
        redis_server: RedisServer, make_store: MakeStore, plain: redis.Redis) -> None:
    store = make_store(redis_server.url)
    blocks, _ = make_blocks(6, seed=10)
    hashes = [b.block_hash for b in blocks]
    await store.put_many(blocks)  # the store now expects values of this length
    plain.set(store.keys.block_key(hashes[3]), b"x" * 100)  # another writer's, shorter
    counts = StoreCounts()
    prefix = await store.fetch_prefix(hashes)
    assert [s.block_hash for s in prefix] == hashes[:3]
    assert counts.moved("corrupt_blocks") == (1,)
    plain.set(store.keys.block_key(hashes[3]), blocks[3].value)
    assert len(await store.fetch_prefix(hashes)) == 6  # the connections are still in step


def test_puts_keep_more_in_flight_over_a_unix_socket_than_over_tcp() -> None:
    """Measured per transport (see redis_config.py); a value given explicitly wins, and a
    bound under one byte is refused."""
    assert RedisStoreConfig(url="unix:///run/redis.sock").put_bytes == 2 << 20
    assert RedisStoreConfig(url="redis://redis:6379/0").put_bytes == 512 << 10
    assert RedisStoreConfig(url="redis://redis:6379/0", put_bytes_in_flight=4096).put_bytes == 4096
    for bad in ({"put_bytes_in_flight": 0}, {"get_bytes_in_flight": 0}, {"connections": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            RedisStoreConfig(**bad)  # type: ignore[arg-type]
