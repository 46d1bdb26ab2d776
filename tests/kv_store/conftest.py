"""Real redis-server fixtures for the block store tests (see ``tests/redis_servers.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_servers import (
    AUTH_PASSWORD,
    RedisClusterServers,
    RedisServer,
    start_cluster,
    start_server,
)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """Shared by a module's well-behaved tests; each test uses its own namespace."""
    server = start_server()
    yield server
    server.stop()


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
