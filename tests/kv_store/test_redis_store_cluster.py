"""The Redis block store against a real three-node Redis Cluster."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster as SyncRedisCluster
from redis_servers import RedisClusterServers
from redis_store_support import (
    SHAPE,
    MakeStore,
    StoreCounts,
    make_blocks,
    same_bits,
    unique_namespace,
)

from cleave.kv_store.codec import header_size

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
    counts = StoreCounts()
    got = await store.get_many([b.block_hash for b in blocks])
    assert got[0] is not None and got[1] is None and got[2] is not None
    assert counts.moved("corrupt_blocks") == (1,)
