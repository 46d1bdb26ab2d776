"""Real redis-server processes for tests: a single node (TCP + unix socket) or a 3-node cluster.

Every process is started in its own short temp dir under /tmp (a unix socket path must stay
under ~108 bytes), waited on with PING within a bound, and stopped with SIGCONT, SIGTERM, then
SIGKILL. Nothing outlives the test run: each server is registered for an ``atexit`` sweep and,
on Linux, gets SIGKILL from the kernel if the test process dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
STARTUP_TIMEOUT = 10.0
CLUSTER_TIMEOUT = 20.0
AUTH_PASSWORD = "s3cret-Pa55word"  # the password of auth-enabled test servers

_live: set[RedisServer] = set()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_DRAW = random.SystemRandom()  # not the global generator: a test that seeds it would make
# two xdist workers draw the same ports


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (bind(0), a client's connect)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*, cluster_bus: bool = False) -> int:
    """A TCP port on 127.0.0.1 nobody has bound (and ``port + 10000`` too, for a cluster),
    below the kernel's ephemeral range: a port handed to a server that binds it later cannot
    be taken meanwhile by the thousands of connections the load tests open, nor by another
    server's bind(0); only by another caller of this function, one draw in thousands."""
    top = _ephemeral_floor() - 1 - (10000 if cluster_bus else 0)
    for _ in range(200):
        port = _DRAW.randint(10000, top)
        if _port_is_free(port) and (not cluster_bus or _port_is_free(port + 10000)):
            return port
    raise RuntimeError(f"no free port below {top + 1}")


@dataclass(eq=False)
class RedisServer:
    port: int
    dir: Path
    unixsocket: Path
    password: str | None
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unixsocket}?db=0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain synchronous client (bytes in, bytes out), authenticated when needed."""
        options: dict[str, object] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        if self.password is not None:
            options["password"] = self.password
        options.update(kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed server."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the socket stays open and accepts, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        try:
            if self.alive():
                self.proc.send_signal(signal.SIGCONT)  # a stopped process ignores SIGTERM
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            _live.discard(self)
            shutil.rmtree(self.dir, ignore_errors=True)


class PortTaken(RuntimeError):
    """Another process bound the port between its choice and redis-server's start."""


def _wait_ready(server: RedisServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            tail = server.log_tail()
            error = PortTaken if "Address already in use" in tail else RuntimeError
            raise error(f"redis-server on port {server.port} exited with "
                        f"{server.proc.returncode}:\n{tail}")
        client = server.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            # Ours, not another redis-server that holds the port (ours then exits, above). A
            # ``command`` wrapper must exec redis-server, keeping this pid, as the pods' do.
            if client.info("server")["process_id"] == server.proc.pid:
                return
        except redis.RedisError as e:
            last = e
        finally:
            client.close()
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {server.port} did not answer PING within "
                       f"{timeout:.0f} s (last error: {last!r}):\n{server.log_tail()}")


def start_server(*, password: str | None = None, port: int | None = None,
                 extra_args: Sequence[str] = (), timeout: float = STARTUP_TIMEOUT,
                 command: Sequence[str] = (REDIS_SERVER,), env: dict[str, str] | None = None,
                 ) -> RedisServer:
    """A fresh redis-server on 127.0.0.1:<free port> and a unix socket, persisting nothing.
    ``command`` runs in its place (e.g. a pod's ``sh -c`` script that execs redis-server with
    the arguments given after it), with ``env`` as its environment. A free port taken by
    another process before redis-server bound it is replaced by another (redis-server takes
    no inherited socket)."""
    for _ in range(4 if port is None else 0):
        with contextlib.suppress(PortTaken):
            return _start_server(password, free_port(), extra_args, timeout, command, env)
    return _start_server(password, free_port() if port is None else port, extra_args, timeout,
                         command, env)


def _start_server(password: str | None, port: int, extra_args: Sequence[str], timeout: float,
                  command: Sequence[str], env: dict[str, str] | None) -> RedisServer:
    workdir = Path(tempfile.mkdtemp(prefix="ckv-", dir="/tmp"))
    sock = workdir / "redis.sock"
    log = workdir / "redis.log"
    args = [*command, "--port", str(port), "--bind", "127.0.0.1",
            "--unixsocket", str(sock), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--logfile", str(log), "--daemonize", "no"]
    if password is not None:
        args += ["--requirepass", password]
    args += list(extra_args)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, cwd=workdir, env=env,
                            preexec_fn=_die_with_parent)
    server = RedisServer(port, workdir, sock, password, proc, log)
    _live.add(server)
    try:
        _wait_ready(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass(eq=False)
class RedisClusterServers:
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_ok(node: RedisServer, size: int) -> bool:
    client = node.client(socket_timeout=1.0)
    try:
        info = client.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return False
    finally:
        client.close()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return ("cluster_state:ok" in text and f"cluster_known_nodes:{size}" in text
            and "cluster_slots_assigned:16384" in text)


def start_cluster(size: int = 3, timeout: float = CLUSTER_TIMEOUT) -> RedisClusterServers:
    """``size`` masters, no replicas, all 16384 slots assigned, ``cluster_state:ok`` on each."""
    cluster = RedisClusterServers()
    try:
        for _ in range(size):
            port = free_port(cluster_bus=True)
            cluster.nodes.append(start_server(port=port, extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "5000"]))
        created = subprocess.run(
            [REDIS_CLI, "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in cluster.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({created.returncode}):\n"
                               f"{created.stdout}\n{created.stderr}")
        deadline = time.monotonic() + timeout
        while not all(_cluster_ok(n, size) for n in cluster.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout:.0f} s:\n"
                                   + "\n".join(n.log_tail(5) for n in cluster.nodes))
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def closed_port() -> int:
    """A port with nothing listening (connection refused)."""
    return free_port()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()

