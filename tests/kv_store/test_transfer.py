"""Bulk SET and GET over several connections from one thread, against a real redis-server:
values land in leased memory, replies other than expected are still read correctly, large
values are spliced or copied, and errors and timeouts leave no connection in use."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis_servers import RedisServer
from redis_store_support import fill

from cleave.kv_store import splice
from cleave.kv_store.buffers import HostBuffers
from cleave.kv_store.resp import Endpoint, RespConnection, RespError, RespPool
from cleave.kv_store.transfer import TransferLimits, get_many_into, set_many

WIDE = TransferLimits(connections=3, depth=2, bytes_in_flight=1 << 20)


@pytest.fixture(params=["tcp", "unix"])
def pool(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[RespPool]:
    url = redis_server.url if request.param == "tcp" else redis_server.unix_url
    p = RespPool(Endpoint.from_url(url), 6, timeout=2.0, connect_timeout=1.0, splice=True)
    yield p
    p.close()


def keep(_: int, value: memoryview | bytearray | None) -> bytes | None:
    return None if value is None else bytes(value)


def test_values_of_known_sizes_land_in_one_lease(pool: RespPool, plain: redis.Redis) -> None:
    values = fill(plain, {b"tr:a": 3 << 20, b"tr:b": 1 << 20, b"tr:c": 70_000})
    keys = list(values)
    buffers = HostBuffers(16 << 20)
    got = get_many_into(pool, keys, buffers, [len(values[k]) for k in keys], lambda _, v: v,
                        WIDE)
    assert [bytes(v) if v is not None else None for v in got] == [values[k] for k in keys]
    assert all(isinstance(v, memoryview) for v in got)  # no value was copied out
    del got
    assert buffers.cached_bytes >= (4 << 20)  # and the lease came back when they went


def test_sizes_from_strlen_and_missing_keys(pool: RespPool, plain: redis.Redis) -> None:
    values = fill(plain, {b"tr:s1": 10, b"tr:s2": 200_000, b"tr:s3": 3})
    plain.delete(b"tr:gone")
    keys = [b"tr:s1", b"tr:gone", b"tr:s2", b"tr:s3", b"tr:gone"]
    got = get_many_into(pool, keys, HostBuffers(8 << 20), None, keep, WIDE)
    assert got == [values[b"tr:s1"], None, values[b"tr:s2"], values[b"tr:s3"], None]


@pytest.mark.parametrize("limits", [WIDE, TransferLimits(1, 4, 1 << 20)])
@pytest.mark.parametrize("told", [
    [100, 5000, 0, 7],  # the second value is shorter than told
    [100, 5, 0, 7],  # longer
    [100, 50, 64, 7],  # the third was expected but is missing
    [0, 50, 0, 7],  # the first was expected missing but is there
])
def test_replies_other_than_told_are_read_the_ordinary_way(
        pool: RespPool, plain: redis.Redis, told: list[int], limits: TransferLimits) -> None:
    values = fill(plain, {b"tr:w1": 100, b"tr:w2": 50, b"tr:w4": 7})
    plain.delete(b"tr:w3")
    keys = [b"tr:w1", b"tr:w2", b"tr:w3", b"tr:w4"]
    seen: list[int] = []

    def each(i: int, value: memoryview | bytearray | None) -> bytes | None:
        seen.append(i)
        return keep(i, value)

    got = get_many_into(pool, keys, HostBuffers(1 << 20), told, each, limits)
    assert got == [values[b"tr:w1"], values[b"tr:w2"], None, values[b"tr:w4"]]
    assert sorted(seen) == [0, 1, 2, 3]  # each once, in whatever order replies completed
    # The connections are still in step with the server.
    assert get_many_into(pool, keys[:2], HostBuffers(1 << 20), None, keep, limits) == [
        values[b"tr:w1"], values[b"tr:w2"]]


def test_more_values_than_fit_in_flight_come_back_in_order(pool: RespPool,
                                                           plain: redis.Redis) -> None:
    values = {b"tr:n%d" % i: os.urandom(5_000 + 997 * i) for i in range(60)}
    blocks = [memoryview(bytearray(v)) for v in values.values()]
    assert set_many(pool, list(zip(values, blocks, strict=True)), 60,
                    TransferLimits(3, 2, 16 << 10)) == 60
    assert all(plain.get(k) == v for k, v in values.items())
    assert 0 < plain.ttl(b"tr:n7") <= 60  # every SET carries the TTL
    got = get_many_into(pool, list(values), HostBuffers(8 << 20), None, keep,
                        TransferLimits(4, 3, 20 << 10))
    assert got == list(values.values())


@pytest.fixture
def spliced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes that went out through a splice pipe."""
    moved: list[int] = []
    take = splice.SplicePipe.take

    def counting(self: splice.SplicePipe, address: int, nbytes: int) -> int:
        n = take(self, address, nbytes)
        moved.append(n)
        return n

    monkeypatch.setattr(splice.SplicePipe, "take", counting)
    return moved


@pytest.mark.parametrize("use_splice", [True, False])
def test_set_many_stores_writable_and_read_only_values_alike(
        redis_server: RedisServer, plain: redis.Redis, use_splice: bool,
        spliced: list[int]) -> None:
    pool = RespPool(Endpoint.from_url(redis_server.unix_url), 4, 2.0, 1.0, splice=use_splice)
    try:
        big = [bytearray(os.urandom(300_000)) for _ in range(6)]  # spliced when on
        small = [os.urandom(1_000 + i) for i in range(6)]  # bytes: always copied
        items: list[tuple[bytes, bytes | memoryview]] = []
        for i in range(6):
            items += [(b"tr:big%d" % i, memoryview(big[i])), (b"tr:small%d" % i, small[i])]
        sealed: list[int] = []
        hooks = [lambda i=i: sealed.append(i) for i in range(len(items))]
        assert set_many(pool, items, 60, WIDE, hooks) == len(items)
        assert sorted(sealed) == list(range(len(items)))  # every hook ran, each once
        # Redis has read every value once set_many returns: changing them now changes nothing.
        originals = [bytes(b) for b in big]
        for b in big:
            b[:] = bytes(len(b))
        assert [plain.get(b"tr:big%d" % i) for i in range(6)] == originals
        assert [plain.get(b"tr:small%d" % i) for i in range(6)] == small
        # The large writable values, and only they, went through the pipe when splicing.
        assert sum(spliced) == (6 * 300_000 if use_splice else 0)
    finally:
        pool.close()


def test_memory_the_kernel_will_not_pin_is_copied(redis_server: RedisServer,
                                                  plain: redis.Redis,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[int] = []

    def refuse(self: splice.SplicePipe, address: int, nbytes: int) -> int:
        refused.append(nbytes)
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(splice.SplicePipe, "take", refuse)
    pool = RespPool(Endpoint.from_url(redis_server.unix_url), 4, 2.0, 1.0, splice=True)
    try:
        values = [os.urandom(200_000) for _ in range(8)]
        items = [(b"tr:pin%d" % i, memoryview(bytearray(v))) for i, v in enumerate(values)]
        assert set_many(pool, items, 60, WIDE) == 8
        assert [plain.get(k) for k, _ in items] == values
        assert 0 < len(refused) <= WIDE.connections  # each connection tried once, then copied
    finally:
        pool.close()


def test_hooks_run_before_their_value_goes_out(pool: RespPool, plain: redis.Redis) -> None:
    value = bytearray(100_000)

    def seal() -> None:
        value[:5] = b"HEAD:"

    set_many(pool, [(b"tr:sealed", memoryview(value))], 60, WIDE, [seal])
    assert plain.get(b"tr:sealed")[:5] == b"HEAD:"  # type: ignore[index]


def test_an_error_reply_raises_and_its_connections_are_closed(pool: RespPool,
                                                               plain: redis.Redis) -> None:
    fill(plain, {b"tr:e1": 1000, b"tr:e3": 1000})
    plain.delete(b"tr:list")
    plain.rpush(b"tr:list", b"x")
    with pytest.raises(RespError, match="WRONGTYPE"):
        get_many_into(pool, [b"tr:e1", b"tr:list", b"tr:e3"], HostBuffers(1 << 20),
                      [1000, 10, 1000], keep, WIDE)
    # The pool lent three connections and got them back closed; the next call reconnects.
    assert pool._idle == [] and pool._free == 6
    assert get_many_into(pool, [b"tr:e1"], HostBuffers(1 << 20), None, keep, WIDE) == [
        plain.get(b"tr:e1")]


def test_a_paused_server_ends_in_a_timeout_within_the_deadline(
        fresh_redis_server: RedisServer) -> None:
    pool = RespPool(Endpoint.from_url(fresh_redis_server.unix_url), 4, 0.5, 0.5, splice=True)
    try:
        values = [memoryview(bytearray(os.urandom(400_000))) for _ in range(40)]
        set_many(pool, [(b"tr:p%d" % i, v) for i, v in enumerate(values)], 60, WIDE)
        fresh_redis_server.pause()
        try:
            for call in (lambda: set_many(pool, [(b"tr:q%d" % i, v)
                                                 for i, v in enumerate(values)], 60, WIDE),
                         lambda: get_many_into(pool, [b"tr:p%d" % i for i in range(40)],
                                               HostBuffers(32 << 20), [400_000] * 40, keep,
                                               WIDE)):
                start = time.monotonic()
                with pytest.raises(TimeoutError):
                    call()
                assert time.monotonic() - start < 1.5
        finally:
            fresh_redis_server.resume()
        # The timed-out connections were closed; fresh ones serve the same pool.
        got = get_many_into(pool, [b"tr:p0"], HostBuffers(1 << 20), None, keep, WIDE)
        assert got == [bytes(values[0])]
    finally:
        pool.close()


def test_two_transfers_at_once_share_the_pool(pool: RespPool, plain: redis.Redis) -> None:
    values = fill(plain, {b"tr:c%d" % i: 50_000 + i for i in range(24)})
    keys = list(values)
    results: list[list[bytes | None]] = []

    def read() -> None:
        results.append(get_many_into(pool, keys, HostBuffers(4 << 20), None, keep, WIDE))

    threads = [threading.Thread(target=read) for _ in range(3)]  # 3 x 3 > the pool's 6
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [list(values.values())] * 3


def test_this_linux_splices_pages_into_unix_sockets_only(redis_server: RedisServer) -> None:
    """The probe found splicing here (Linux, where CI and the benchmark run), so their puts
    over a unix socket take the zero-copy path; over TCP (measured slower) they copy."""
    assert splice.AVAILABLE
    assert splice.address_of(memoryview(b"read-only")) is None  # bytes are never spliced
    unix = RespConnection(Endpoint.from_url(redis_server.unix_url), 2.0, 1.0, splice=True)
    tcp = RespConnection(Endpoint.from_url(redis_server.url), 2.0, 1.0, splice=True)
    try:
        assert unix.pipe is not None and tcp.pipe is None
    finally:
        unix.close()
        tcp.close()


# -- a server that misbehaves (a narrow fake: Redis itself never does this) ------------------

def fake_server(path: Path, serve: Callable[[socket.socket], None]) -> socket.socket:
    """Listen on a unix socket; each connection is handed to ``serve`` in a thread."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def test_a_connection_the_server_closes_ends_the_transfer_at_once(tmp_path: Path) -> None:
    def hang_up(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        conn.close()

    listener = fake_server(tmp_path / "s.sock", hang_up)
    pool = RespPool(Endpoint.from_url(f"unix://{tmp_path / 's.sock'}"), 4, 5.0, 1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RespError, match="closed by the server"):
            get_many_into(pool, [b"a", b"b"], HostBuffers(1 << 20), [100, 100], keep, WIDE)
        assert time.monotonic() - start < 2.0  # not the 5 s timeout
        assert pool._idle == [] and pool._free == 4
    finally:
        pool.close()
        listener.close()


def test_a_reply_trickling_in_still_ends_at_the_deadline(tmp_path: Path) -> None:
    """A value of another length than expected is read by the ordinary parser: each of its
    waits gets only what is left of the call's time, not the whole timeout again."""
    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        conn.sendall(b"$1000\r\n")
        try:
            for _ in range(60):  # a byte every 50 ms for 3 s, then the rest at once
                if stop.wait(0.05):
                    return
                conn.sendall(b"x")
            conn.sendall(b"x" * 940 + b"\r\n")
            conn.recv(1)
        except OSError:
            return

    listener = fake_server(tmp_path / "t.sock", trickle)
    pool = RespPool(Endpoint.from_url(f"unix://{tmp_path / 't.sock'}"), 4, 0.5, 0.5)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            get_many_into(pool, [b"k"], HostBuffers(1 << 20), [10], keep, WIDE)
        # The 0.5 s deadline, with a loaded box's slack; far below the 3 s of trickle that a
        # fresh timeout per wait would sit through.
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        pool.close()
        listener.close()


def test_a_value_not_followed_by_crlf_is_a_protocol_error(tmp_path: Path) -> None:
    def garble(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        conn.sendall(b"$10\r\n" + b"0123456789" + b"XX")
        conn.recv(1)  # hold the connection until the client closes it

    listener = fake_server(tmp_path / "g.sock", garble)
    pool = RespPool(Endpoint.from_url(f"unix://{tmp_path / 'g.sock'}"), 4, 2.0, 1.0)
    try:
        with pytest.raises(RespError, match="not followed by CRLF"):
            get_many_into(pool, [b"k"], HostBuffers(1 << 20), [10], keep, WIDE)
        assert pool._idle == [] and pool._free == 4
    finally:
        pool.close()
        listener.close()
