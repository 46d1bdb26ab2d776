"""Real redis-server fixtures for the block store tests (see ``tests/redis_servers.py``), and the
block stores the tests make on them."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_servers import (
    AUTH_PASSWORD,
    RedisClusterServers,
    RedisServer,
    start_cluster,
    start_server,
)

from cleave.kv_store.block_hash import KVFingerprint
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore

# The test modules here import their shared helpers from ``redis_store_support`` next to them.
sys.path.append(str(Path(__file__).parent))

from redis_store_support import FP, HEALTHY_TIMEOUT, MakeStore, unique_namespace


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A server of its own, for a test that kills or pauses it."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_redis_server() -> Iterator[RedisServer]:
    server = start_server(password=AUTH_PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    cluster = start_cluster(3)
    yield cluster
    cluster.stop()


@pytest.fixture
async def make_store() -> AsyncIterator[MakeStore]:
    stores: list[RedisBlockStore] = []

    def make(url: str, *, namespace: str | None = None, fp: KVFingerprint = FP,
             **config: Any) -> RedisBlockStore:
        config.setdefault("timeout_seconds", HEALTHY_TIMEOUT)
        config.setdefault("connect_timeout_seconds", HEALTHY_TIMEOUT)
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
