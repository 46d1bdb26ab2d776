"""The lean RESP client against a real redis-server: its ordinary replies, and the pool."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_servers import RedisServer
from redis_store_support import fill

from cleave.kv_store.resp import Endpoint, RespConnection, RespError, RespPool


@pytest.fixture(params=["tcp", "unix"])
def conn(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[RespConnection]:
    url = redis_server.url if request.param == "tcp" else redis_server.unix_url
    c = RespConnection(Endpoint.from_url(url), timeout=2.0, connect_timeout=1.0)
    yield c
    c.close()


def test_strlen_many_reports_zero_for_missing(conn: RespConnection, plain: redis.Redis) -> None:
    fill(plain, {b"resp:l1": 1234})
    plain.delete(b"resp:l2")
    assert conn.strlen_many([b"resp:l1", b"resp:l2"]) == [1234, 0]


def test_an_error_reply_raises(conn: RespConnection, plain: redis.Redis) -> None:
    plain.delete(b"resp:list")
    plain.rpush(b"resp:list", b"x")
    with pytest.raises(RespError, match="WRONGTYPE"):
        conn.strlen_many([b"resp:list"])


def test_more_bytes_than_the_scratch_holds_can_be_put_back_and_parsed(
        conn: RespConnection) -> None:
    value = os.urandom(70_000)  # more than the 64 KiB scratch buffer
    conn.unread(memoryview(b"$70000\r\n" + value + b"\r\n"))
    assert conn.read_reply() == value


def test_a_failed_connect_gives_its_pool_slot_back(tmp_path: Path) -> None:
    pool = RespPool(Endpoint.from_url(f"unix://{tmp_path / 'absent.sock'}"), 1, timeout=1.0,
                    connect_timeout=0.5)
    for _ in range(2):  # the second try connects again: it does not wait for a lost slot
        with pytest.raises(OSError) as failed:
            pool.take(1, time.monotonic() + 1.0)
        assert not isinstance(failed.value, TimeoutError)
    assert pool._free == 1


def test_the_pool_hands_out_what_is_free_and_waits_for_the_rest(
        redis_server: RedisServer) -> None:
    pool = RespPool(Endpoint.from_url(redis_server.url), 3, timeout=2.0, connect_timeout=1.0)
    try:
        deadline = time.monotonic() + 2.0
        first = pool.take(2, deadline)
        assert len(first) == 2
        second = pool.take(5, deadline)
        assert len(second) == 1  # one was left: fewer than asked, never more than the size
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.take(1, time.monotonic() + 0.2)
        assert time.monotonic() - start < 1.0
        pool.give_back(first, healthy=True)
        again = pool.take(4, deadline)
        assert {id(c) for c in again} == {id(c) for c in first}  # reused, not reconnected
        pool.give_back(second, healthy=False)
        assert second[0].sock.fileno() == -1  # out of step: closed, never reused
        assert len(pool.take(4, deadline)) == 1  # its slot came back
    finally:
        pool.close()
