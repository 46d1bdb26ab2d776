"""``cleave up`` as a real subprocess, for the scale tests: its log, its worker processes, the
router's own view of its workers, and a Ctrl-C that must leave nothing behind."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from cleave.runtime.serving.up import said_port

CLI = [sys.executable, "-m", "cleave.common.cli"]


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its command line."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True,
                         check=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        tree.setdefault(parent, []).append(child)
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            try:
                found[c] = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text().lower()
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             log: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}\n{log()[-5000:]}")
        time.sleep(0.2)


class Up:
    """One ``cleave up`` with the tiny model; every process it ever started is remembered so
    the final Ctrl-C can be checked for orphans."""

    def __init__(self, model: Path, logdir: Path, *args: str) -> None:
        self.model = str(model)
        self.port = 0  # the router's, once wait_up read it from the "Cleave is up" line
        self.log_path = logdir / f"up-{secrets.token_hex(4)}.log"
        self.proc = subprocess.Popen(
            [*CLI, "up", "--model", self.model, "--dtype", "float32", "--kv-cache-memory",
             "8MiB", "--port", "0", "--disaggregate-min-tokens", "16",
             "--startup-timeout", "180", *args],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ))
        self.seen: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self, timeout: float = 180) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.log()[-5000:]
            self.port = said_port(self.log()) or 0
            return self.port != 0
        wait_for(up, timeout, "cleave up ready", self.log)

    def worker_pids(self) -> list[int]:
        procs = descendants(self.proc.pid)
        self.seen |= set(procs)
        return [pid for pid, cmd in procs.items() if " worker " in cmd and alive(pid)]

    def router_workers(self) -> dict[str, list[dict[str, object]]]:
        with urllib.request.urlopen(self.url + "/internal/workers", timeout=5) as r:
            return dict(json.loads(r.read()))

    def healthy(self, role: str) -> int:
        return sum(1 for w in self.router_workers()[role] if w["healthy"])

    def ctrl_c_leaves_nothing(self) -> None:
        self.worker_pids()
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(timeout=90) == 0, self.log()[-5000:]
        deadline = time.monotonic() + 5
        while [p for p in self.seen if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [p for p in self.seen if alive(p)]
        assert not orphans, f"orphans left: {orphans}"

    def kill(self) -> None:
        """After a failed test: nothing of this run may outlive it."""
        if self.proc.poll() is None:
            self.worker_pids()
            self.proc.kill()
            self.proc.wait()
        for pid in self.seen:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"cleave.common.cli" in cmd or b"redis-server" in cmd:  # ours, not a reused pid
                os.kill(pid, signal.SIGKILL)
