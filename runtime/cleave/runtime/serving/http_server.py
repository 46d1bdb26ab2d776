"""Cleave's HTTP servers, the router's and the workers', started one way under one bound.

The bound is a header read deadline (``--header-read-timeout``): a connection whose request
line and headers are not complete within that many seconds of its opening, or of its previous
response on a keep-alive connection, is closed. Without it a client that trickles its headers a
byte at a time (slowloris) holds the connection, and a file descriptor, for as long as it likes;
enough such clients exhaust the server's descriptors and nobody else gets in.

aiohttp (pinned to 3.14.*) has no setting by that name, but its ``keepalive_timeout`` is one
(aiohttp/web_protocol.py, ``RequestHandler``): its timer is armed when a connection opens
(``connection_made``: "there's no other protection against a dead connection that doesn't send
a request at all") and again after each response, arriving bytes do not push it back, and when
it fires while the connection still waits for a complete request (``_process_keepalive``:
"handler in idle state") the connection is force-closed. Once a request's headers are in, its
handler runs and the timer does nothing: a slow body stays ``BODY_READ_SECONDS``' business (a
408), a long streamed answer runs to its end. So this module only has to set it, everywhere,
from the one setting; without it the router had ``web.run_app``'s 75 s and the workers
``RequestHandler``'s 3630 s. tests/reliability/test_attack_slowloris.py holds aiohttp to this
behaviour against real router and worker processes, so an upgrade that changes it fails there.

The same timer is the longest an idle keep-alive connection lives: a proxy in front that pools
connections must drop idle ones sooner (docs/operations.md, Security model).

A server either binds its ``host:port`` or serves on a socket its parent bound for it
(``--listen-fd``): ``cleave up`` binds every port itself (:func:`bound_socket`), so no other
process can take a port between its choice and the server's start, and ``--port 0`` works.
"""

from __future__ import annotations

import socket
from typing import Any

from aiohttp import web

from cleave.common.flags import flag_name
from cleave.common.settings import HttpSettings

# The flag (cleave worker's and cleave router's listen_fd setting) that hands a server the
# socket bound for it: cleave up's processes and the tests' take it.
LISTEN_FD_FLAG = flag_name("listen_fd")


def handler_options(http: HttpSettings) -> dict[str, Any]:
    """The aiohttp request-handler options that carry ``http``'s bounds (``web.run_app`` and
    ``web.AppRunner`` both pass them to every connection's ``RequestHandler``)."""
    seconds = http.header_read_timeout
    if not seconds > 0:  # 0 would disarm aiohttp's timer: no bound at all (and NaN fails too)
        raise ValueError(f"--header-read-timeout must be > 0 (got {seconds:g})")
    return {"keepalive_timeout": seconds}


def bound_socket(host: str, port: int, *, listen: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port), for a server to inherit.

    SO_REUSEADDR, so that a restart binds its port again over its predecessor's TIME_WAIT
    connections (they keep the flag of the socket that accepted them: without it there, the
    restart's bind fails for a minute). While only bound, another SO_REUSEADDR socket could
    bind the same port and listen first; ``listen`` makes the port this socket's alone at once
    (connections then wait until the server serves), not listening refuses them at once.
    Each address the host resolves to is tried in turn. OSError when the port is taken or
    the host unknown, ValueError for a port outside 0-65535."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it round (70000 -> 4464)
        raise ValueError(f"port must be 0-65535 (got {port})")
    error: OSError = OSError(f"{host!r} resolves to no address")
    for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            if listen:
                sock.listen()
            return sock
        except OSError as e:  # e.g. ::1 first for "localhost" where IPv6 is off
            sock.close()
            error = e
    raise error


def inherited_socket(fd: int) -> socket.socket:
    """The socket a parent passed as ``--listen-fd``; ValueError when ``fd`` is not an open
    socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ValueError(f"{LISTEN_FD_FLAG} {fd} is not an open socket "
                         f"({e.strerror})") from None
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.detach()  # not ours to close
        raise ValueError(f"{LISTEN_FD_FLAG} {fd} is not a TCP socket")
    sock.set_inheritable(False)  # this server's alone: a process it starts must not hold it
    return sock


def run(app: web.Application, host: str, port: int, http: HttpSettings,
        sock: socket.socket | None = None, **options: Any) -> None:
    """Serve ``app`` until SIGTERM/SIGINT (``web.run_app``, quiet: no banner, no access log),
    under ``http``'s bounds, on ``host:port`` or an inherited ``sock``; ``options`` go to
    ``web.run_app`` too."""
    where: dict[str, Any] = {"host": host, "port": port} if sock is None else {"sock": sock}
    web.run_app(app, print=None, access_log=None, **where, **handler_options(http), **options)


async def start(app: web.Application, host: str, port: int, http: HttpSettings,
                sock: socket.socket | None = None) -> web.AppRunner:
    """Start serving ``app`` under ``http``'s bounds (no access log), on ``host:port`` or an
    inherited ``sock``; the caller stops it with the returned runner's ``cleanup()``."""
    runner = web.AppRunner(app, access_log=None, **handler_options(http))
    await runner.setup()
    site = web.TCPSite(runner, host, port) if sock is None else web.SockSite(runner, sock)
    await site.start()
    return runner
