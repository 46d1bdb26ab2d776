"""cleave up's processes own their ports: bound by cleave up before each launch, passed down as
``--listen-fd``, held by the child alone, and bound again for a restart.

Stand-in processes (no model): the socket handling is the Supervisor's, whatever runs on it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleave.common.settings import WorkerSettings
from cleave.runtime.serving import http_server
from cleave.runtime.serving.local_processes import Supervisor

# A worker stand-in: listens on the socket it was given, notes its pid and port, and closes
# each connection it accepts (its end then waits in TIME_WAIT, as a killed worker's do).
STAND_IN = r"""
import os, socket, sys
sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--listen-fd") + 1]))
sock.listen()
with open(os.environ["PORTS"], "a") as f:
    f.write(f"{os.getpid()} {sock.getsockname()[1]}\n")
while True:
    sock.accept()[0].close()
"""


def _noted(path: Path, lines: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + 30
    while True:
        text = path.read_text() if path.exists() else ""
        if len(text.splitlines()) >= lines:
            return [(int(a), int(b)) for a, b in (line.split() for line in text.splitlines())]
        assert time.monotonic() < deadline, text
        time.sleep(0.05)


@pytest.fixture()
def supervisor(tmp_path: Path) -> Iterator[tuple[Supervisor, Path, list[str]]]:
    said: list[str] = []
    ports = tmp_path / "ports"
    sup = Supervisor([sys.executable, "-c", STAND_IN], {"PORTS": str(ports)}, WorkerSettings(),
                     say=said.append)
    yield sup, ports, said
    sup.stop_all(grace=5)


def test_a_workers_port_is_its_own_from_launch_and_through_a_restart(
        supervisor: tuple[Supervisor, Path, list[str]]) -> None:
    sup, ports, said = supervisor
    worker = sup.spawn_worker("both")
    port = worker.address[1]
    assert worker.url == f"http://127.0.0.1:{port}"
    assert f"--port={port}" in worker.command  # what it reports, in its logs and --check
    [(pid, served)] = _noted(ports, 1)
    assert (pid, served) == (worker.proc.pid, port)
    with socket.socket() as thief, pytest.raises(OSError) as taken:  # nobody else binds it
        thief.bind(("127.0.0.1", port))
    assert taken.value.errno == 98  # EADDRINUSE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        assert client.recv(1) == b""  # the worker closed first: TIME_WAIT on its port

    os.kill(pid, signal.SIGKILL)
    worker.proc.wait(timeout=10)
    # cleave up kept no copy of the socket: with its worker gone the port refuses at once
    # (the router fails over) rather than queueing connections nobody accepts.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    assert sup.watch(startup_timeout=60) is None
    assert any("restarting it (1/5)" in line for line in said), said
    [_, (again, served_again)] = _noted(ports, 2)
    assert again == worker.proc.pid != pid and served_again == port


def test_a_restart_whose_port_was_taken_stops_cleave_up(
        supervisor: tuple[Supervisor, Path, list[str]]) -> None:
    sup, ports, _ = supervisor
    worker = sup.spawn_worker("both")
    [(pid, port)] = _noted(ports, 1)
    os.kill(pid, signal.SIGKILL)
    worker.proc.wait(timeout=10)
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", port))
        thief.listen()
        reason = sup.watch(startup_timeout=60)
    assert reason == f"both-0 cannot listen on http://127.0.0.1:{port} again: " \
                     "Address already in use"


def test_the_router_serves_on_the_socket_it_is_given(tmp_path: Path) -> None:
    ports = tmp_path / "ports"
    sup = Supervisor([sys.executable, "-c", STAND_IN], {"PORTS": str(ports)}, WorkerSettings(),
                     say=lambda _: None)
    sock = http_server.bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        router = sup.start_router(["router"], sock)
        assert router.url == f"http://127.0.0.1:{port}"
        assert sock.fileno() == -1  # closed here once launched: the router's alone
        assert _noted(ports, 1) == [(router.proc.pid, port)]
    finally:
        sup.stop_all(grace=5)
