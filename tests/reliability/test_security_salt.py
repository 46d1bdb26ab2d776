"""Security: one service's cache salt (or namespace) cannot read another's KV blocks.

Real engines on the tiny model and a real redis-server. Tenant A prefills a prompt through the
store; tenant B, identical except for its salt, shares the Redis and even the namespace, and
still finds nothing: not by the prompt, not by A's block hashes, not by A's raw values. A
second engine with A's salt does find them, so the isolation is the salt's doing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from figures import report
from redis_servers import RedisServer

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.codec import CorruptBlock, decode
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.kv_connector import KVStoreConnector

PROMPT = "the engineer builds many books before dinner " * 8


@pytest.fixture
async def tenant(tiny_engine_factory: Callable[..., Any], redis_server: RedisServer
                 ) -> AsyncIterator[Callable[[str, str], KVStoreConnector]]:
    made: list[KVStoreConnector] = []

    def make(salt: str, namespace: str = "shared") -> KVStoreConnector:
        engine = AsyncEngine(tiny_engine_factory(salt=salt))
        keys = KeySpace(namespace, engine.engine.root_hash)
        connector = KVStoreConnector(engine, RedisBlockStore(
            keys, RedisStoreConfig(url=redis_server.url, timeout_seconds=5.0)))
        made.append(connector)
        return connector

    yield make
    for c in made:
        await c.store.close()
        c.engine.shutdown()


async def test_a_different_salt_reads_none_of_the_blocks(tenant, redis_server: RedisServer
                                                         ) -> None:  # type: ignore[no-untyped-def]
    a, b = tenant("tenant-a"), tenant("tenant-b")
    prompt = a.engine.engine.tokenize(PROMPT)
    await a.prefill(prompt, SamplingParams(max_tokens=1))
    a_hashes = chain_hashes(a.root_hash, prompt[:-1], a.block_size)
    assert len(a_hashes) >= 4
    assert len((await a.load_prefix(prompt)).blocks) == len(a_hashes)  # type: ignore[union-attr]
    same_salt = tenant("tenant-a")  # a fresh engine with A's salt: the blocks are there
    assert len((await same_salt.load_prefix(prompt)).blocks) == len(a_hashes)  # type: ignore[union-attr]

    assert await b.load_prefix(prompt) is None
    # Even given A's hashes, B's keys live under B's fingerprint: nothing to read.
    assert await b.store.get_many(a_hashes) == [None] * len(a_hashes)
    assert await b.store.longest_cached_prefix(a_hashes) == 0
    # And A's raw values, read around the store, do not verify as B's blocks.
    plain = redis_server.client()
    b_hashes = chain_hashes(b.root_hash, prompt[:-1], b.block_size)
    for a_hash, b_hash in zip(a_hashes, b_hashes, strict=True):
        value = plain.get(a.store.keys.block_key(a_hash))
        assert value is not None
        with pytest.raises(CorruptBlock):
            decode(value, expected_hash=b_hash)
    b_keys = plain.keys(b.store.keys.prefix + b"*")
    assert b_keys == []
    report("security_salt", blocks_saved_by_a=len(a_hashes), read_by_b=0,
           read_by_same_salt=len(a_hashes))


async def test_a_different_namespace_reads_none_of_the_blocks(tenant) -> None:  # type: ignore[no-untyped-def]
    a = tenant("same-salt", namespace="service-a")
    other = tenant("same-salt", namespace="service-b")
    prompt = a.engine.engine.tokenize(PROMPT)
    await a.prefill(prompt, SamplingParams(max_tokens=1))
    assert await a.load_prefix(prompt) is not None
    assert await other.load_prefix(prompt) is None
