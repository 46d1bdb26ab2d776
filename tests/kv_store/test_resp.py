"""The lean RESP client's GET path against a real redis-server: values land in leased memory,
and a reply other than expected (rewritten, expired, an error) is still read correctly."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from redis_servers import RedisServer

from cleave.kv_store.buffers import HostBuffers
from cleave.kv_store.resp import Endpoint, RespConnection, RespError


@pytest.fixture(params=["tcp", "unix"])
def conn(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[RespConnection]:
    url = redis_server.url if request.param == "tcp" else redis_server.unix_url
    c = RespConnection(Endpoint.from_url(url), timeout=2.0, connect_timeout=1.0)
    yield c
    c.close()


@pytest.fixture
def plain(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def keep(_: int, value: memoryview | bytearray | None) -> bytes | None:
    return None if value is None else bytes(value)


def fill(plain: redis.Redis, sizes: dict[bytes, int]) -> dict[bytes, bytes]:
    values = {k: os.urandom(n) for k, n in sizes.items()}
    plain.delete(*values)
    plain.mset(values)
    return values


def test_values_of_known_sizes_land_in_one_lease(conn: RespConnection,
                                                 plain: redis.Redis) -> None:
    values = fill(plain, {b"resp:a": 3 << 20, b"resp:b": 1 << 20, b"resp:c": 70_000})
    keys = list(values)
    buffers = HostBuffers(16 << 20)
    got = conn.get_many_into(keys, buffers, [len(values[k]) for k in keys],
                             lambda _, v: v)
    assert [bytes(v) if v is not None else None for v in got] == [values[k] for k in keys]
    assert all(isinstance(v, memoryview) for v in got)  # no value was copied out
    del got
    assert buffers.cached_bytes >= (4 << 20)  # and the lease came back when they went


def test_sizes_from_strlen_and_missing_keys(conn: RespConnection, plain: redis.Redis) -> None:
    values = fill(plain, {b"resp:s1": 10, b"resp:s2": 200_000, b"resp:s3": 3})
    plain.delete(b"resp:gone")
    keys = [b"resp:s1", b"resp:gone", b"resp:s2", b"resp:s3", b"resp:gone"]
    got = conn.get_many_into(keys, HostBuffers(8 << 20), None, keep)
    assert got == [values[b"resp:s1"], None, values[b"resp:s2"], values[b"resp:s3"], None]


@pytest.mark.parametrize("told", [
    [100, 5000, 0, 7],  # the second value is shorter than told
    [100, 5, 0, 7],  # longer
    [100, 50, 64, 7],  # the third was expected but is missing
    [0, 50, 0, 7],  # the first was expected missing but is there
])
def test_replies_other_than_told_are_read_the_ordinary_way(
        conn: RespConnection, plain: redis.Redis, told: list[int]) -> None:
    values = fill(plain, {b"resp:w1": 100, b"resp:w2": 50, b"resp:w4": 7})
    plain.delete(b"resp:w3")
    keys = [b"resp:w1", b"resp:w2", b"resp:w3", b"resp:w4"]
    seen: list[int] = []

    def each(i: int, value: memoryview | bytearray | None) -> bytes | None:
        seen.append(i)
        return keep(i, value)

    got = conn.get_many_into(keys, HostBuffers(1 << 20), told, each)
    assert got == [values[b"resp:w1"], values[b"resp:w2"], None, values[b"resp:w4"]]
    assert seen == [0, 1, 2, 3]
    # The connection is still in step with the server.
    assert conn.get_many_into([b"resp:w2"], HostBuffers(1 << 20), None, keep) == [
        values[b"resp:w2"]]


def test_an_error_reply_raises(conn: RespConnection, plain: redis.Redis) -> None:
    plain.delete(b"resp:list")
    plain.rpush(b"resp:list", b"x")
    with pytest.raises(RespError, match="WRONGTYPE"):
        conn.get_many_into([b"resp:list"], HostBuffers(1 << 20), [10], keep)


def test_strlen_many_reports_zero_for_missing(conn: RespConnection, plain: redis.Redis) -> None:
    fill(plain, {b"resp:l1": 1234})
    plain.delete(b"resp:l2")
    assert conn.strlen_many([b"resp:l1", b"resp:l2"]) == [1234, 0]
