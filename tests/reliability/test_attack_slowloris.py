"""Attack: slowloris (issue 15, item 4), against a real router and a real worker process.

A client opens a connection and trickles its request headers a byte at a time, never finishing
them: each such client holds a connection and a file descriptor, and enough of them exhaust the
server's. Before: the router (``web.run_app``'s keep-alive default) held one 75 s, a worker
(``web.AppRunner``'s) 3630 s. Now both close it ``--header-read-timeout`` seconds after it
opened (serving/http_server.py). The figure gives how long each held the attacker, and a
normal keep-alive client's requests on one connection across several deadlines. The metrics
servers of ``cleave up --autoscale`` and the operator (autoscaling/metrics_server.py; before,
prometheus_client's, which held one for ever) get the same bound.
"""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from figures import report
from serving_stack import Proc, start_stack
from up_stack import running_up

from cleave.autoscaling.metrics_server import start_metrics_server

DEADLINE = 3.0  # --header-read-timeout, router and worker
SLACK = 5.0  # a loaded 2-core box; the broken behaviour holds 75 s (router) or 3630 s (worker)
TRICKLE = 0.5  # seconds between header bytes
HEADERS = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def _address(p: Proc) -> tuple[str, int]:
    host, port = p.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def slowloris(address: tuple[str, int]) -> float:
    """Seconds the server held a connection whose headers never end (stops trying at
    DEADLINE + SLACK)."""
    with socket.create_connection(address, timeout=TRICKLE) as s:
        start = time.monotonic()
        s.sendall(HEADERS + b"X-Slow: ")
        while time.monotonic() - start < DEADLINE + SLACK:
            try:
                if s.recv(4096) == b"":
                    break  # closed by the server
                raise AssertionError("the server answered headers that never ended")
            except TimeoutError:
                pass  # still open: one more byte
            except ConnectionError:
                break
            try:
                s.sendall(b"a")
            except ConnectionError:
                break
        return time.monotonic() - start


def _response(s: socket.socket) -> bytes:
    """One whole response (``Content-Length`` framed, as /health answers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, "the server closed a keep-alive connection between requests"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(4096)
    return head.split(b"\r\n", 1)[0]


def keep_alive(p: Proc, requests: int) -> list[bytes]:
    """Status lines of ``requests`` requests in a row on one connection, each sent 0.4 of a
    deadline after the previous answer (1.8 s to spare on a loaded box; a deadline that never
    restarted would have closed the connection before the fourth request)."""
    statuses = []
    with socket.create_connection(_address(p), timeout=30) as s:
        for i in range(requests):
            if i:
                time.sleep(DEADLINE * 0.4)
            s.sendall(HEADERS + b"\r\n")
            statuses.append(_response(s))
    return statuses


def test_slowloris_is_closed_at_the_header_deadline(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    flag = ("--header-read-timeout", str(DEADLINE))
    stack = start_stack(tiny_model_dir, tmp_path, prefill=0, decode=1, router_args=flag,
                        worker_args=flag)
    try:
        targets = {"router": stack.router, "worker": stack.workers[0]}
        with ThreadPoolExecutor(4) as pool:
            held = {name: pool.submit(slowloris, _address(p)) for name, p in targets.items() if p}
            served = {name: pool.submit(keep_alive, p, 5) for name, p in targets.items() if p}
            held_s = {name: round(f.result(), 2) for name, f in held.items()}
            statuses = {name: f.result() for name, f in served.items()}
        report("attack_slowloris", header_read_timeout_s=DEADLINE, held_s=held_s,
               held_s_before={"router": 75, "worker": 3630},
               keep_alive_requests={k: len(v) for k, v in statuses.items()})
        for name, seconds in held_s.items():
            assert DEADLINE - 0.5 < seconds < DEADLINE + SLACK, (name, seconds)
        for name, lines in statuses.items():
            assert lines == [b"HTTP/1.1 200 OK"] * 5, (name, lines)
    finally:
        stack.stop()


def test_the_metrics_server_closes_slowloris_at_the_header_deadline() -> None:
    httpd, _ = start_metrics_server(0, "127.0.0.1", header_read_timeout=DEADLINE)
    try:
        address = ("127.0.0.1", httpd.server_port)
        held_s = round(slowloris(address), 2)
        with socket.create_connection(address, timeout=30) as s:  # a scrape still works
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        report("attack_slowloris_metrics", header_read_timeout_s=DEADLINE, held_s=held_s,
               held_s_before="unbounded (prometheus_client.start_http_server)")
        assert DEADLINE - 0.5 < held_s < DEADLINE + SLACK, held_s
        assert answer.startswith(b"HTTP/1.0 200 OK"), answer[:100]
        assert b"python_info" in answer or b"process_" in answer, answer[:300]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_cut_off_malformed_request_line_logs_nothing(capfd: pytest.CaptureFixture[str]
                                                       ) -> None:
    """A request line that never ends, cut at the deadline, is not answered: writing its 400
    to the shut socket printed a traceback per connection (an attacker's log flood)."""
    httpd, _ = start_metrics_server(0, "127.0.0.1", header_read_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", httpd.server_port), timeout=10) as s:
            s.sendall(b"XYZ")
            assert s.recv(100) == b""  # closed at the deadline, nothing answered
        time.sleep(0.3)  # the handler thread ends after the socket closes
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_cleave_up_passes_the_deadline_to_every_server(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    """``cleave up --header-read-timeout``: the router, the worker and the autoscaler's
    metrics server it starts all close a slowloris connection at that deadline."""
    with running_up(tiny_model_dir, tmp_path, prefill=0, decode=1,
                    extra_args=("--header-read-timeout", str(DEADLINE),
                                "--autoscale", "--advisory")) as up:
        # The autoscaler's metrics server starts just after the "Cleave is up" banner.
        pattern = r"autoscaler metrics on http://([\d.]+):(\d+)/metrics"
        deadline = time.monotonic() + 30
        while (metrics := re.search(pattern, up.log_text())) is None:
            assert time.monotonic() < deadline, up.log_text()[-2000:]
            time.sleep(0.1)
        targets = {"router": ("127.0.0.1", up.port),
                   "worker": ("127.0.0.1", up.workers()[0].port),
                   "metrics": (metrics[1], int(metrics[2]))}
        with ThreadPoolExecutor(3) as pool:
            held = {name: pool.submit(slowloris, a) for name, a in targets.items()}
            held_s = {name: round(f.result(), 2) for name, f in held.items()}
    report("attack_slowloris_up", header_read_timeout_s=DEADLINE, held_s=held_s)
    for name, seconds in held_s.items():
        assert DEADLINE - 0.5 < seconds < DEADLINE + SLACK, (name, seconds)
