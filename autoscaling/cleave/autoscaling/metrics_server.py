"""A Prometheus ``/metrics`` server with a header read deadline (the operator's metrics, and
``cleave up --autoscale``'s).

``prometheus_client.start_http_server`` (a thread per connection, wsgiref) reads a request's
line and headers with no time limit: a client that trickles them a byte at a time (slowloris)
holds a thread and a file descriptor for ever. This is the same server (the same WSGI app and
threading server) whose connections are shut down when their request line and headers are not
in within ``header_read_timeout`` seconds of opening: the bound the router and the workers have
(cleave/runtime/serving/http_server.py), with the same default. wsgiref answers one request per
connection (HTTP/1.0), so "of opening" is the whole rule here. ``cleave up --autoscale`` and the
operator serve their metrics with it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from cleave.common.settings import HttpSettings

DEFAULT_HEADER_READ_TIMEOUT = HttpSettings().header_read_timeout


class _DeadlineHandler(WSGIRequestHandler):
    """Shuts its connection down if the headers are not parsed in time: the thread blocked
    reading them then sees end-of-file and ends."""

    header_read_timeout = DEFAULT_HEADER_READ_TIMEOUT  # set per server by start_metrics_server

    def setup(self) -> None:
        super().setup()
        self._lock = threading.Lock()
        self._headers_in = False
        self._expired = False
        self._timer = threading.Timer(self.header_read_timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if not self._headers_in:
                self._expired = True
                with contextlib.suppress(OSError):  # the client may be gone already
                    self.connection.shutdown(socket.SHUT_RDWR)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers (what came before a shutdown)
        with self._lock:
            if self._expired:  # cut off: answer nothing (not a traceback on a closed socket)
                return False
            self._headers_in = True  # the answer is not cut short, however slow
        self._timer.cancel()
        return ok

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """Nothing to a connection cut off: parse_request answers a malformed request line
        before the check above, and writing to the shut socket printed a traceback."""
        if not self._expired:
            super().send_error(code, message, explain)

    def finish(self) -> None:
        self._timer.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing, as prometheus_client's handler."""


def start_metrics_server(port: int, addr: str = "0.0.0.0",
                         header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT
                         ) -> tuple[WSGIServer, threading.Thread]:
    """``prometheus_client.start_http_server(port, addr)`` under a header read deadline: the
    server (``server_port`` is the port bound, for port 0) and its daemon thread."""
    if not header_read_timeout > 0:
        raise ValueError(f"header_read_timeout must be > 0 (got {header_read_timeout:g})")

    class Server(ThreadingWSGIServer):  # a class per server: the family is a class attribute
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

    class Handler(_DeadlineHandler):
        pass

    Handler.header_read_timeout = header_read_timeout
    httpd = make_server(addr, port, make_wsgi_app(REGISTRY), Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    return httpd, thread
