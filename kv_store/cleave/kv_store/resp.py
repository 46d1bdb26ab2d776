"""A minimal RESP2 client for the block store's bulk path: connections, a reply parser, a pool.

redis-py copies a large value three to four times on its way in or out (asyncio's write
buffer, the parser's buffer, the reply object). Blocks are 64 KiB-1 MiB and move by the
hundred, so the store talks to a single Redis node through plain sockets instead: SETs go out
by scatter-gather ``sendmsg`` straight from the exported tensors (zero copies), and GET replies
are received straight into reused memory (one copy, the kernel's; see ``buffers`` and
``transfer``). Calls run in worker threads, so the event loop and the engine keep running;
every socket wait is bounded by the store's timeout, so no call can hang.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.connection import parse_url

from cleave.kv_store.splice import AVAILABLE as SPLICE_AVAILABLE
from cleave.kv_store.splice import SplicePipe

T = TypeVar("T")
_CRLF = b"\r\n"
MAX_IOV = 512  # well under IOV_MAX (1024 on Linux)
_SEND_BUFFER = 4 << 20


class RespError(OSError):
    """A protocol or server error; the connection it came from is closed."""


@dataclass(frozen=True)
class Endpoint:
    unix_path: str | None
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def from_url(cls, url: str, username: str | None = None,
                 password: str | None = None) -> Endpoint:
        """The URL read as redis-py reads it (its own parser: the two paths must agree on the
        credentials), with explicitly given ones winning."""
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "unix"):
            raise ValueError(f"the fast path takes redis:// or unix:// URLs, not {scheme}://")
        parts: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        return cls(
            unix_path=parts.get("path") if scheme == "unix" else None,
            host=parts.get("host") or "127.0.0.1", port=int(parts.get("port") or 6379),
            db=int(parts.get("db") or 0),
            username=username if username is not None else parts.get("username"),
            password=password if password is not None else parts.get("password"))


def command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out += [b"$%d\r\n" % len(p), p, _CRLF]
    return b"".join(out)


def advance(parts: list[memoryview], sent: int) -> None:
    """Drop the ``sent`` bytes from the front of a scatter-gather list."""
    while parts and sent >= parts[0].nbytes:
        sent -= parts.pop(0).nbytes
    if sent:
        parts[0] = parts[0][sent:]


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the KV store did not answer within the timeout")
    return left


class RespConnection:
    def __init__(self, endpoint: Endpoint, timeout: float, connect_timeout: float,
                 splice: bool = False, deadline: float | None = None) -> None:
        """Connect (and AUTH/SELECT), all within ``connect_timeout`` and ``deadline``."""
        if deadline is None:
            deadline = time.monotonic() + timeout + connect_timeout
        address: str | tuple[str, int]
        if endpoint.unix_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address = endpoint.unix_path
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            address = (endpoint.host, endpoint.port)
        self.sock = sock
        self.pipe: SplicePipe | None = None
        # Replies are parsed from a fixed scratch buffer; [_start, _end) is unread.
        self._scratch = bytearray(1 << 16)
        self._start = self._end = 0
        self._deadline: float | None = None  # while set, each receive waits only until it
        try:
            # Puts stream megabytes: with the default ~208 KiB send buffer the writer and
            # Redis took turns waking each other; 4 MiB (the kernel caps it at wmem_max) made
            # a 45 MiB put 40 % faster here. Reads are bounded by Redis's own send buffer.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            sock.settimeout(min(connect_timeout, _left(deadline)))
            sock.connect(address)
            sock.settimeout(timeout)
            # Large values go out spliced through this pipe when the kernel can (splice.py):
            # over a unix socket, where it was measured to help (10-30 % on puts); over
            # loopback TCP it did not (puts ran 20 % slower), so TCP copies.
            self.pipe = (SplicePipe() if splice and SPLICE_AVAILABLE and endpoint.unix_path
                         else None)
            setup: list[bytes] = []
            if endpoint.password is not None:
                auth = [endpoint.username.encode()] if endpoint.username else []
                setup.append(command(b"AUTH", *auth, endpoint.password.encode()))
            if endpoint.db:
                setup.append(command(b"SELECT", str(endpoint.db).encode()))
            if setup:
                self._send([b"".join(setup)])
                for _ in setup:
                    self.read_reply_before(deadline)
                sock.settimeout(timeout)
        except BaseException:
            self.close()  # a refused AUTH must not leave the socket (or pipe) open
            raise

    def close(self) -> None:
        self.sock.close()
        if self.pipe is not None:
            self.pipe.close()

    # -- wire ----------------------------------------------------------------------------
    def _send(self, parts: Sequence[bytes | memoryview]) -> None:
        for start in range(0, len(parts), MAX_IOV):
            chunk = [memoryview(p).cast("B") for p in parts[start:start + MAX_IOV]]
            while chunk:
                advance(chunk, self.sock.sendmsg(chunk))

    def _fill(self) -> None:
        """Receive more bytes behind the unread ones in the scratch buffer."""
        if self._start:
            unread = self._end - self._start
            self._scratch[:unread] = self._scratch[self._start:self._end]
            self._start, self._end = 0, unread
        if self._end == len(self._scratch):
            self._scratch.extend(bytes(len(self._scratch)))  # a very long line: grow
        self._arm()
        n = self.sock.recv_into(memoryview(self._scratch)[self._end:])
        if not n:
            raise RespError("connection closed by the server")
        self._end += n

    def _arm(self) -> None:
        """Under a deadline, give the next receive only the time left before it (a reply
        trickling in must not wait the whole timeout again at every chunk)."""
        if self._deadline is not None:
            self.sock.settimeout(_left(self._deadline))

    def read_reply_before(self, deadline: float) -> bytearray | int | bytes | None:
        """:meth:`read_reply`, all of it received by ``deadline`` or TimeoutError."""
        self._deadline = deadline
        try:
            return self.read_reply()
        finally:
            self._deadline = None

    def take_buffered(self, into: memoryview) -> int:
        """Move already-received bytes to the front of ``into``; returns how many."""
        n = min(self._end - self._start, into.nbytes)
        into[:n] = memoryview(self._scratch)[self._start:self._start + n]
        self._start += n
        return n

    def unread(self, data: memoryview) -> None:
        """Put ``data`` back in front of the unread bytes, to be parsed the ordinary way."""
        pending = bytes(data) + bytes(self._scratch[self._start:self._end])
        if len(pending) > len(self._scratch):
            self._scratch.extend(bytes(len(pending) - len(self._scratch)))
        self._scratch[:len(pending)] = pending
        self._start, self._end = 0, len(pending)

    def _line(self) -> bytes:
        while (end := self._scratch.find(_CRLF, self._start, self._end)) < 0:
            self._fill()
        line = bytes(self._scratch[self._start:end])
        self._start = end + 2
        return line

    def _bulk(self, size: int) -> bytearray:
        """``size`` bytes plus CRLF; all but what was already buffered lands in place."""
        out = bytearray(size)
        view = memoryview(out)
        got = self.take_buffered(view)
        while got < size:
            self._arm()
            n = self.sock.recv_into(view[got:])
            if not n:
                raise RespError("connection closed mid-value")
            got += n
        while self._end - self._start < 2:
            self._fill()
        self._start += 2
        return out

    def read_reply(self) -> bytearray | int | bytes | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self._bulk(size)
        if kind == b"-":
            raise RespError(f"Redis error: {rest.decode(errors='replace')}")
        raise RespError(f"unexpected reply {line[:40]!r}")

    # -- small pipelines -----------------------------------------------------------------
    def strlen_many(self, keys: Sequence[bytes]) -> list[int]:
        """Each value's length; 0 for a missing key."""
        self._send([b"".join(command(b"STRLEN", k) for k in keys)])
        return [self._int_reply() for _ in keys]

    def _int_reply(self) -> int:
        reply = self.read_reply()
        if not isinstance(reply, int):
            raise RespError(f"expected an integer reply, got {reply!r:.40}")
        return reply


class RespPool:
    """At most ``size`` connections; one that failed in any way is closed, never reused.

    Idle connections are blocking, with the store's timeout on every wait.
    """

    def __init__(self, endpoint: Endpoint, size: int, timeout: float,
                 connect_timeout: float, splice: bool = False) -> None:
        self.endpoint = endpoint
        self.splice = splice
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._idle: list[RespConnection] = []
        self._free = size  # connections that may still be taken (idle or not yet made)
        self._closed = False
        self._changed = threading.Condition()

    def take(self, want: int, deadline: float) -> list[RespConnection]:
        """Between one and ``want`` connections, as many as are free (call from a thread)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._free > 0,
                                          max(0.0, deadline - time.monotonic())):
                raise TimeoutError("no store connection free within the timeout")
            n = min(want, self._free)
            self._free -= n
            conns = [self._idle.pop() for _ in range(min(n, len(self._idle)))]
        try:
            while len(conns) < n:
                conns.append(RespConnection(self.endpoint, self.timeout, self.connect_timeout,
                                            self.splice, deadline))
        except BaseException:
            for conn in conns:
                conn.close()
            self._release([], n)
            raise
        return conns

    def give_back(self, conns: Sequence[RespConnection], healthy: bool) -> None:
        """Return connections; ones that are not ``healthy`` (out of step) are closed."""
        if healthy:
            for conn in conns:
                conn.sock.settimeout(self.timeout)
        self._release(conns if healthy else [], len(conns), close=[] if healthy else conns)

    def _release(self, idle: Sequence[RespConnection], slots: int,
                 close: Sequence[RespConnection] = ()) -> None:
        with self._changed:  # decided under the lock: a pool closing now keeps nothing
            doomed = [*close, *idle] if self._closed else list(close)
            if not self._closed:
                self._idle.extend(idle)
            self._free += slots
            self._changed.notify_all()
        for conn in doomed:
            conn.close()

    @contextmanager
    def lend(self, want: int, deadline: float) -> Iterator[list[RespConnection]]:
        """:meth:`take` for the block, given back after it: closed if it raised."""
        conns = self.take(want, deadline)
        healthy = False
        try:
            yield conns
            healthy = True
        finally:
            self.give_back(conns, healthy)

    def run(self, work: Callable[..., T], *args: Any, deadline: float | None = None) -> T:
        """Run ``work(connection, *args)`` on one blocking connection (call from a thread),
        within ``deadline`` (default: the timeout from now)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        with self.lend(1, deadline) as (conn,):
            conn.sock.settimeout(_left(deadline))
            return work(conn, *args)

    def close(self) -> None:
        """Close the idle connections; lent ones are closed when they come back."""
        with self._changed:
            self._closed = True
            for conn in self._idle:
                conn.close()
            self._idle.clear()
