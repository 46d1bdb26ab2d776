"""serving/http_server.py: the header read deadline leaves slow bodies to their own bound.

The slowloris attack itself, on real router and worker processes, is
tests/reliability/test_attack_slowloris.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cleave.common.settings import HttpSettings
from cleave.runtime.serving import http_server
from cleave.runtime.serving.router import Router, RouterConfig

DEADLINE = 1.0  # header read deadline
BODY_SECONDS = 3.0  # the router's body read bound, longer than the header deadline


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_deadline_that_bounds_nothing_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="--header-read-timeout"):
        http_server.handler_options(HttpSettings(header_read_timeout=seconds))


@pytest.mark.parametrize("command", ["router", "worker", "up"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_the_flag_refuses_a_deadline_that_bounds_nothing(
        command: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cleave.common.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser(load=[command]).parse_args([command, "--header-read-timeout", value])
    assert exit_.value.code == 2
    assert "--header-read-timeout" in capsys.readouterr().err


def test_the_flag_reaches_both_servers() -> None:
    from cleave.common.cli import build_parser
    from cleave.common.settings import RouterSettings, WorkerSettings

    for command, cls in (("router", RouterSettings), ("worker", WorkerSettings)):
        args = build_parser(load=[command]).parse_args([command, "--header-read-timeout", "2.5"])
        assert cls.from_args(args).http.header_read_timeout == 2.5
        assert cls().http.header_read_timeout == 75.0


def test_a_slow_body_still_gets_its_408_after_the_header_deadline(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers complete in time, then a body trickled in: the header deadline passes and
    the connection stays open until the body bound answers 408."""
    from cleave.runtime.serving import router as router_module

    monkeypatch.setattr(router_module, "BODY_READ_SECONDS", BODY_SECONDS)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    router = Router(RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",)),
                    tokenizer, 512, 512)

    async def run() -> tuple[bytes, float]:
        sock = http_server.bound_socket("127.0.0.1", 0)  # as cleave up hands it down
        port = sock.getsockname()[1]
        runner = await http_server.start(router.app(), "127.0.0.1", 1,  # --port, unused
                                         HttpSettings(header_read_timeout=DEADLINE), sock)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = time.monotonic()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            status = asyncio.ensure_future(reader.readline())
            while not status.done() and time.monotonic() - start < BODY_SECONDS + 10:
                writer.write(b" ")  # whitespace: still valid JSON so far
                await asyncio.sleep(0.5)
            line = await asyncio.wait_for(status, 1)
            writer.close()
            return line, time.monotonic() - start
        finally:
            await runner.cleanup()

    line, seconds = asyncio.run(run())
    assert line.split()[1:2] == [b"408"], line
    assert seconds > DEADLINE + 0.5, seconds  # it outlived the header deadline


@pytest.mark.parametrize("fd", ["file", "closed"])
def test_a_listen_fd_that_is_no_socket_is_a_clear_error(fd: str, tmp_path: Path) -> None:
    with (tmp_path / "f").open("w") as f:
        number = f.fileno() if fd == "file" else 1000 + f.fileno()
        with pytest.raises(ValueError, match=f"--listen-fd {number} is not an open socket"):
            http_server.inherited_socket(number)

    unix, other = socket.socketpair()
    with unix, other, pytest.raises(ValueError, match="is not a TCP socket"):
        http_server.inherited_socket(unix.fileno())


@pytest.mark.parametrize("command", [["router", "--decode", "http://127.0.0.1:9"], ["worker"]])
def test_the_servers_refuse_a_listen_fd_that_is_no_socket(
        command: list[str], tiny_model_dir: Path, tmp_path: Path) -> None:
    with (tmp_path / "not-a-socket").open("w") as f:
        fd = f.fileno()
        done = subprocess.run([sys.executable, "-m", "cleave.common.cli", *command, "--model",
                               str(tiny_model_dir), "--listen-fd", str(fd), "--check"],
                              pass_fds=(fd,), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--listen-fd {fd} is not an open socket (Socket operation on non-socket)" \
        in done.stderr


def test_a_listening_socket_is_its_ports_alone_a_bound_one_is_not() -> None:
    """cleave up binds with SO_REUSEADDR (a restart must bind over TIME_WAIT connections), so
    another SO_REUSEADDR socket (asyncio's default) could share a port only bound, and listen
    first: a worker's first socket and the router's listen from the start."""
    def thief(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return s

    with http_server.bound_socket("127.0.0.1", 0) as bound:
        port = bound.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):  # refused until the server listens
            socket.create_connection(("127.0.0.1", port), timeout=5)
        thief(port).close()  # shared while only bound
    with http_server.bound_socket("127.0.0.1", 0, listen=True) as held:
        with pytest.raises(OSError, match="Address already in use"):
            thief(held.getsockname()[1])
        socket.create_connection(held.getsockname(), timeout=5).close()  # it waits
    with pytest.raises(ValueError, match="port must be 0-65535"):
        http_server.bound_socket("127.0.0.1", 70000)  # not wrapped round to 4464


def test_a_restart_binds_its_port_over_the_dead_servers_time_wait() -> None:
    """A worker killed with connections open leaves them in TIME_WAIT on its port; they carry
    the accepting socket's SO_REUSEADDR, which the restart's bind needs (a CI run met a
    restart refused when the first socket lacked it)."""
    with http_server.bound_socket("127.0.0.1", 0, listen=True) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    with http_server.bound_socket("127.0.0.1", port) as again:
        assert again.getsockname()[1] == port


def _check(command: list[str], sock: socket.socket, model: Path
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CLEAVE_INTERNAL_TOKEN"}
    return subprocess.run([sys.executable, "-m", "cleave.common.cli", *command, "--model",
                           str(model), "--port", "1", "--listen-fd", str(sock.fileno()),
                           "--check"], pass_fds=(sock.fileno(),), capture_output=True,
                          text=True, timeout=120, env=env)


def test_the_inherited_sockets_address_wins_over_host_and_port(tiny_model_dir: Path) -> None:
    with http_server.bound_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        done = _check(["router", "--decode", "http://127.0.0.1:9"], sock, tiny_model_dir)
    assert done.returncode == 0, done.stderr
    assert f"listening on 127.0.0.1:{port}" in done.stdout
    # A worker handed a socket on every address needs the internal token, whatever --host says.
    with http_server.bound_socket("0.0.0.0", 0) as everywhere:
        done = _check(["worker"], everywhere, tiny_model_dir)
    assert done.returncode == 2
    assert "listening on 0.0.0.0 needs an internal token" in done.stderr
