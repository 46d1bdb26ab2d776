"""``cleave up`` as a real subprocess, with handles on the processes it starts.

The reliability tests run the platform exactly as a user does (``python -m cleave.common.cli
up``) and then reach into it: each worker is found by the port it logs
(``... worker listening on http://127.0.0.1:PORT``) and by its pid among ``cleave up``'s
children, so a test can SIGKILL one, wait for it to come back, and read its RSS.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cleave.runtime.serving.up import said_port

CLI = [sys.executable, "-m", "cleave.common.cli"]
STARTUP_TIMEOUT = 180.0  # a loaded 2-core CI box imports torch in five processes at once
_LISTENING = re.compile(r"\[ *(\w+-\d+)\] .* worker listening on http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class Worker:
    name: str  # "prefill-0", "decode-1" as cleave up labels its log lines
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _stop_with_parent() -> None:  # in the child before exec
    # SIGTERM, not SIGKILL: cleave up then stops its own workers if the test run dies.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def children(pid: int) -> dict[int, str]:
    """Direct children of ``pid`` and their command lines."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True,
                         check=True).stdout
    found = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        if parent == pid:
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                found[child] = cmd.decode(errors="replace")
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid``, at any depth, and its command line."""
    found: dict[int, str] = {}
    parents = [pid]
    while parents:
        layer = {c: cmd for p in parents for c, cmd in children(p).items()}
        found |= layer
        parents = list(layer)
    return found


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def get_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class UpProcess:
    """One ``cleave up`` process, its merged log, and its workers."""

    def __init__(self, model: Path, logdir: Path, *, prefill: int = 2, decode: int = 2,
                 redis_url: str | None = None, env: Mapping[str, str] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.model = str(model)
        self.port = 0  # the router's, once wait_up read it from the "Cleave is up" line
        self.log = logdir / f"up-{secrets.token_hex(4)}.log"
        args = [*CLI, "up", "--model", self.model, "--dtype", "float32",
                "--kv-cache-memory", "16MiB", "--port", "0",
                "--prefill", str(prefill), "--decode", str(decode),
                "--disaggregate-min-tokens", "16", "--startup-timeout", str(STARTUP_TIMEOUT),
                *extra_args]
        if redis_url is not None:
            args += ["--redis-url", redis_url]
        self.proc = subprocess.Popen(args, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     preexec_fn=_stop_with_parent)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while (port := said_port(self.log_text())) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cleave up exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"cleave up not up in {timeout:.0f} s:\n"
                                   f"{self.log_text()[-4000:]}")
            time.sleep(0.2)
        self.port = port

    def workers(self) -> list[Worker]:
        """Every worker, by name; a restarted one keeps its name and port."""
        found = {name: int(port) for name, port in _LISTENING.findall(self.log_text())}
        return [Worker(name, port) for name, port in sorted(found.items())]

    def worker(self, name: str) -> Worker:
        return next(w for w in self.workers() if w.name == name)

    def pid_of(self, worker: Worker) -> int:
        for pid, cmd in children(self.proc.pid).items():
            # cleave up writes worker command lines with WorkerSettings.to_args: --port=N
            if " worker " in cmd and f" --port={worker.port} " in f" {cmd} ":
                return pid
        raise LookupError(f"no live process for {worker.name} on port {worker.port}")

    def router_pid(self) -> int:
        return next(pid for pid, cmd in children(self.proc.pid).items() if " router " in cmd)

    def kill_worker(self, name: str) -> int:
        """SIGKILL a worker (a crash, an OOM kill); returns the pid that died."""
        pid = self.pid_of(self.worker(name))
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_worker_back(self, name: str, old_pid: int, timeout: float = 120.0) -> int:
        """Wait until ``cleave up`` has restarted the worker and it answers /ready."""
        deadline = time.monotonic() + timeout
        worker = self.worker(name)
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"cleave up exited:\n{self.log_text()[-4000:]}"
            with contextlib.suppress(LookupError):
                pid = self.pid_of(worker)
                if pid != old_pid and get_ok(worker.url + "/ready"):
                    return pid
            time.sleep(0.2)
        raise AssertionError(f"{name} not back in {timeout:.0f} s:\n{self.log_text()[-4000:]}")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def running_up(model: Path, logdir: Path, **kwargs: object) -> Iterator[UpProcess]:
    up = UpProcess(model, logdir, **kwargs)  # type: ignore[arg-type]
    try:
        up.wait_up()
        yield up
    finally:
        up.stop()


def metric_total(url: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples on a ``/metrics`` page, over those matching ``labels``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total
