"""Start a private redis-server for one machine: benchmarks and ``cleave up``.

Listens on a unix socket (the fastest loopback transport), and with ``tcp`` on a free 127.0.0.1
port too (benchmarks compare the two), with persistence off (the store is a cache: every block
has a TTL and can be recomputed).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis


class RedisNotInstalled(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalRedis:
    proc: subprocess.Popen[bytes]
    port: int  # 0: no TCP listener
    unixsocket: Path
    workdir: Path

    @property
    def tcp_url(self) -> str:
        if not self.port:
            raise RuntimeError("this redis-server listens on its unix socket only (tcp=False)")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unixsocket}?db=0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_redis(maxmemory: str = "0", timeout: float = 10.0,
                      tcp: bool = False) -> LocalRedis:
    """Start redis-server and wait until it answers PING (or raise with its log). Without
    ``tcp`` it has no port another process could take first (port 0: unix socket only)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisNotInstalled("redis-server is not installed (Debian: apt-get install "
                                "redis-server), or pass the URL of a running Redis")
    workdir = Path(tempfile.mkdtemp(prefix="cleave-redis-"))
    sock = workdir / "redis.sock"
    port = _free_port() if tcp else 0
    log = workdir / "redis.log"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(sock),
         "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(workdir),
         "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--logfile", str(log)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = LocalRedis(proc, port, sock, workdir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if redis.Redis(unix_socket_path=str(sock), socket_timeout=0.5).ping():
                return server
        except (redis.RedisError, OSError):
            time.sleep(0.05)
    text = log.read_text() if log.exists() else ""
    server.stop()
    raise RuntimeError(f"redis-server did not start within {timeout} s:\n{text[-2000:]}")
