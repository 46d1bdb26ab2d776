"""A real local deployment for tests: redis-server, worker processes and the router.

Every process is a real ``cleave`` command on a free port; tests talk to the router over
HTTP with the official ``openai`` client, and can kill any piece to test faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from redis_servers import RedisServer, start_server

from cleave.runtime.serving import http_server

CLI = [sys.executable, "-m", "cleave.common.cli"]
SERVED = "tiny"  # the model name clients ask for, and the vllm:* metrics' model_name


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Stack:
    model: str
    redis: RedisServer
    workers: list[Proc] = field(default_factory=list)
    router: Proc | None = None

    @property
    def base_url(self) -> str:
        assert self.router is not None
        return self.router.url + "/v1"

    def stop(self) -> None:
        for p in [*( [self.router] if self.router else []), *self.workers]:
            p.stop()
        self.redis.stop()


def spawn(name: str, args: list[str], logdir: Path) -> Proc:
    """``cleave worker`` or ``cleave router`` on a free port, bound here and handed down as
    ``--listen-fd`` (as ``cleave up`` does): no other process can take it before the server
    starts, nor answer its ``/ready``."""
    log = logdir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with http_server.bound_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        proc = subprocess.Popen(
            [*CLI, *args, "--port", str(port), http_server.LISTEN_FD_FLAG, str(sock.fileno())],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, pass_fds=(sock.fileno(),))
    return Proc(name, proc, f"http://127.0.0.1:{port}", log)


def wait_ready(p: Proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited:\n{p.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(p.url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{p.name} not ready in {timeout} s:\n{p.log.read_text()[-3000:]}")


def start_worker(stack: Stack, role: str, logdir: Path, name: str | None = None,
                 extra: tuple[str, ...] = (), served: tuple[str, ...] = (SERVED,)) -> Proc:
    p = spawn(name or f"{role}-{len(stack.workers)}",
              ["worker", "--role", role, "--model", stack.model,
               "--served-model-name", *served,
               "--dtype", "float32", "--kv-cache-memory", "8MiB",
               "--redis-url", stack.redis.unix_url, "--store-timeout", "0.5",
               "--grace-period", "5", *extra], logdir)
    stack.workers.append(p)
    return p


def start_stack(model: Path, logdir: Path, prefill: int = 1, decode: int = 1,
                router_args: tuple[str, ...] = (), dns: bool = False,
                worker_args: tuple[str, ...] = (), served: tuple[str, ...] = (SERVED,)
                ) -> Stack:
    """``dns``: the router finds workers by resolving a name (as a headless Service);
    ``worker_args``: more flags for every worker; ``served``: the --served-model-name names
    of every process."""
    stack = Stack(str(model), start_server())
    try:
        for _ in range(prefill):
            start_worker(stack, "prefill", logdir, extra=worker_args, served=served)
        for _ in range(decode):
            start_worker(stack, "decode", logdir, extra=worker_args, served=served)
        for w in stack.workers:
            wait_ready(w)
        args = ["router", "--model", stack.model, "--served-model-name", *served,
                "--disaggregate-min-tokens", "16",
                "--redis-url", stack.redis.unix_url, *router_args]
        for w in stack.workers:
            url = w.url.replace("http://127.0.0.1", "dns+http://localhost") if dns else w.url
            args += ["--prefill" if w.name.startswith("prefill") else "--decode", url]
        stack.router = spawn("router", args, logdir)
        wait_ready(stack.router)
    except BaseException:
        stack.stop()
        raise
    return stack


def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
