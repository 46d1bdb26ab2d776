"""The processes of ``cleave up``: start, watch, restart, drain and stop them.

One :class:`Supervisor` owns every worker and the router. The main thread calls
:meth:`Supervisor.watch` twice a second (crashes, restarts, readiness); the autoscaler thread
starts and drains workers. A lock guards the process list, and once :meth:`Supervisor.stop_all`
has begun nothing new starts, so Ctrl-C cannot race a scale-up into an orphan.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from cleave.common.settings import WorkerSettings
from cleave.runtime.serving import http_server
from cleave.runtime.serving.gpus import VISIBLE, least_used
from cleave.runtime.serving.membership import write_members

MAX_WORKER_RESTARTS = 5  # per worker; a worker that keeps dying takes the platform down
STARTING, READY, DRAINING = "starting", "ready", "draining"


# Every process serves on a socket cleave up bound for it (http_server.bound_socket, handed
# down as LISTEN_FD_FLAG): a port chosen with bind(0) and released again could be taken by
# another process before the server bound it, and a /ready answered by that process would
# pass for this one's.
LISTEN_FD_FLAG = http_server.LISTEN_FD_FLAG


def answers_ready(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _relay(name: str, proc: subprocess.Popen[bytes]) -> None:
    """One merged log stream: every line of every process, prefixed with its name."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        print(f"[{name:>10}] {raw.decode(errors='replace').rstrip()}", flush=True)


@dataclass
class LocalProcess:
    name: str
    role: str  # prefill, decode, both, router
    address: tuple[str, int]  # where it listens, on a socket cleave up binds for each launch
    command: list[str]  # without LISTEN_FD_FLAG: each launch adds its socket's
    env: dict[str, str]
    proc: subprocess.Popen[bytes] = field(init=False)
    state: str = STARTING
    launched_at: float = 0.0
    restarts: int = 0
    gpu: str | None = None  # its CUDA_VISIBLE_DEVICES, when cleave up spreads workers

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def launch(self, sock: socket.socket) -> None:
        """Start it on ``sock`` (bound to its address; a restart binds it again)."""
        try:
            # Own session: a Ctrl-C in the terminal reaches cleave up alone, which then
            # stops every child in order instead of all of them dying at once.
            self.proc = subprocess.Popen(
                [*self.command, LISTEN_FD_FLAG, str(sock.fileno())], env=self.env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                pass_fds=(sock.fileno(),))
        finally:
            # The child's alone from here: once it exits the port refuses connections at
            # once (the router fails over) instead of queueing them for nobody.
            sock.close()
        self.launched_at = time.monotonic()
        self.state = STARTING
        threading.Thread(target=_relay, args=(self.name, self.proc), daemon=True).start()


class Supervisor:
    def __init__(self, cli: Sequence[str], env: dict[str, str],
                 worker: WorkerSettings, workers_file: Path | None = None,
                 say: Callable[[str], None] | None = None, gpus: Sequence[str] = ()) -> None:
        self._cli = list(cli)
        self._env = env
        self._worker = worker  # every worker's settings but its role and port
        self._gpus = list(gpus)  # spread workers over these (gpus.py); empty: leave env as is
        self.workers_file = workers_file
        self._say = say or (lambda line: print(line, flush=True))
        self._lock = threading.Lock()
        self._processes: list[LocalProcess] = []
        self._next_index: dict[str, int] = {}
        self._closed = False

    def say(self, line: str) -> None:
        self._say(f"cleave up: {line}")

    # -- starting ---------------------------------------------------------------------------
    def spawn_worker(self, role: str) -> LocalProcess:
        with self._lock:
            if self._closed:
                raise RuntimeError("stopping: no new workers")
            index = self._next_index.get(role, 0)
            self._next_index[role] = index + 1
            # Listening: the port is its alone from here (a worker is listed for the router
            # only once ready, so nothing but the /ready probe waits on it meanwhile).
            sock = http_server.bound_socket(self._worker.host, 0, listen=True)
            settings = replace(self._worker, role=role, port=sock.getsockname()[1])
            env, gpu = self._env, None
            if self._gpus:
                gpu = least_used(self._gpus, [q.gpu for q in self._processes if q.gpu])
                env = dict(env, **{VISIBLE: gpu})
            p = LocalProcess(f"{role}-{index}", role, (settings.host, settings.port),
                             [*self._cli, "worker", *settings.to_args()], env, gpu=gpu)
            p.launch(sock)
            self._processes.append(p)
            return p

    def start_router(self, command: list[str], sock: socket.socket) -> LocalProcess:
        """The router, on ``sock`` (bound by cleave up before anything else started)."""
        host, port = sock.getsockname()[:2]
        with self._lock:
            p = LocalProcess("router", "router", (host, port), [*self._cli, *command],
                             self._env)
            p.launch(sock)
            self._processes.append(p)
            return p

    def wait_ready(self, processes: Sequence[LocalProcess], timeout: float) -> None:
        """Block until each answers /ready; RuntimeError if one exits or time runs out."""
        deadline = time.monotonic() + timeout
        pending = list(processes)
        while pending:
            for p in list(pending):
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with code {p.proc.returncode}")
                if answers_ready(p.url):
                    self.mark_ready(p)
                    pending.remove(p)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s: "
                                   f"{', '.join(p.name for p in pending)}")
            time.sleep(0.2)

    # -- views ------------------------------------------------------------------------------
    def workers(self, roles: Sequence[str], state: str) -> list[LocalProcess]:
        with self._lock:
            return [p for p in self._processes if p.role in roles and p.state == state]

    def all(self) -> list[LocalProcess]:
        with self._lock:
            return list(self._processes)

    # -- membership -------------------------------------------------------------------------
    def mark_ready(self, p: LocalProcess) -> bool:
        """A starting worker answered ``/ready``: list it for the router. Only from STARTING:
        the answer was asked outside the lock, and the autoscaler may have begun draining the
        worker meanwhile; listing it then would send requests to a worker about to get
        SIGTERM. Returns whether it was marked."""
        with self._lock:
            if p.state != STARTING:
                return False
            p.state = READY
            self._publish()
            return True

    def _publish(self) -> None:
        """Tell the router (through the workers file) which workers take requests: the ready
        ones. Called with the lock held, on every state change."""
        if self.workers_file is None:
            return
        ready = [p for p in self._processes if p.state == READY]
        write_members(self.workers_file, {
            "prefill": [p.url for p in ready if p.role == "prefill"],
            "decode": [p.url for p in ready if p.role in ("decode", "both")]})

    def publish(self) -> None:
        with self._lock:
            self._publish()

    def begin_drain(self, p: LocalProcess) -> str:
        """Take a worker out of the router's list; returns the state it was in. The caller
        waits for the router to let go of it, then calls :meth:`terminate`."""
        with self._lock:
            was = p.state
            p.state = DRAINING
            self._publish()
            return was

    def terminate(self, p: LocalProcess) -> None:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)  # the worker finishes what it has, then exits

    def forget(self, p: LocalProcess) -> None:
        with self._lock:
            if p in self._processes:
                self._processes.remove(p)

    # -- watching ---------------------------------------------------------------------------
    def watch(self, startup_timeout: float) -> str | None:
        """Restart crashed workers, mark started ones ready; returns why everything must stop
        (the router died, a worker kept dying or never got ready), else None."""
        for p in self.all():
            if p.state == DRAINING:
                continue  # its exit is expected; the drain reaps it
            code = p.proc.poll()
            if code is not None:
                with self._lock:
                    # Under the lock: a drain may have begun (and SIGTERMed it) since the
                    # check above, and its exit is then no crash at all.
                    if p.state == DRAINING or self._closed:
                        continue
                    if p.role == "router" or p.restarts >= MAX_WORKER_RESTARTS:
                        return f"{p.name} exited with code {code}"
                    # As Kubernetes restarts a crashed pod: same command, same port, so the
                    # router takes it back once it is ready again.
                    p.restarts += 1
                    self.say(f"{p.name} exited with code {code}; restarting it "
                             f"({p.restarts}/{MAX_WORKER_RESTARTS})")
                    try:
                        sock = http_server.bound_socket(*p.address)
                    except OSError as e:  # another process bound its port meanwhile
                        return f"{p.name} cannot listen on {p.url} again: {e.strerror}"
                    try:
                        p.launch(sock)
                    except OSError as e:
                        return f"{p.name} could not be restarted: {e}"
                    self._publish()
            elif p.state == STARTING:
                if answers_ready(p.url, timeout=0.5):
                    if self.mark_ready(p):
                        self.say(f"{p.name} is ready ({p.url})")
                elif time.monotonic() - p.launched_at > startup_timeout:
                    return f"{p.name} not ready after {startup_timeout:.0f} s"
        return None

    # -- stopping ---------------------------------------------------------------------------
    def stop_all(self, grace: float = 40.0) -> None:
        """SIGTERM all, then SIGKILL what outlives the workers' own drain period."""
        with self._lock:
            self._closed = True
            processes = list(self._processes)
        for p in processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in processes:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
