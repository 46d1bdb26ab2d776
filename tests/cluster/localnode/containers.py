"""One container of a pod: a process group started through the launcher, its restarts,
back-off, probes and status, driven by its pod's thread (``tick``); nothing here blocks.

Each container is its own process group (a new session), so a stop signals everything it
started; after the main process exits, whatever is left of its group is killed, as the
runtime would when the container's cgroup goes. Exits are noticed without reaping first
(``waitid(WNOWAIT)``), so the group id cannot be reused before that kill.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .env import ConfigError, command_line, container_env
from .probes import Probe
from .volumes import container_mounts

if TYPE_CHECKING:
    from .pods import PodRuntime

Obj = dict[str, Any]
LAUNCHER = str(Path(__file__).with_name("launcher.py"))


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    def __init__(self, pod: PodRuntime, spec: Obj) -> None:
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.log_path = pod.node.workdir / "logs" / f"{pod.namespace}_{pod.name}_{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.waiting = ("ContainerCreating", "")  # (reason, message) while not running
        self.restart_count, self.crashes = 0, 0
        self.next_start = 0.0
        self.started_at, self.started_mono = "", 0.0
        self.last_state: Obj = {}
        self.done: Obj | None = None  # the final ``terminated`` state when it won't restart
        self.kill_deadline: float | None = None
        self.probes: dict[str, Probe] = {}
        self.ready = self.started = False
        self.ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports") or []
                      if p.get("name")}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def tick(self, now: float) -> None:
        if self.proc is not None:
            if self._exited():
                self._on_exit(now)
            elif self.kill_deadline is not None:
                if now >= self.kill_deadline:
                    self._signal(signal.SIGKILL)
            else:
                self._run_probes(now)
        elif self.done is None and now >= self.next_start and not self.pod.stopping:
            self._start(now)

    def _start(self, now: float) -> None:
        pod = self.pod
        try:
            self.env = container_env(pod.obj, self.spec, pod.node.get, pod.ip, pod.node.host_ip,
                                     pod.node.api_endpoint, pod.node.image_env)
            argv = command_line(self.spec, self.env)
            mounts = container_mounts(self.spec, pod.volumes, pod.sa_dir)
            launch = pod.security(self.spec)
        except ConfigError as e:
            self.waiting, self.next_start = ("CreateContainerConfigError", str(e)), now + 1.0
            return
        hidden = Path(launch["reveal"][0]) if launch.get("reveal") else None
        pod.node.mount_points.ensure(mounts, hidden)
        spec_path = pod.dir / f"{self.name}.launch.json"
        spec_path.write_text(json.dumps({
            **launch, "argv": argv, "env": self.env, "hostname": pod.hostname,
            "workingDir": self.spec.get("workingDir") or "/",
            "mounts": [{"source": str(m.source), "target": m.target, "readOnly": m.read_only}
                       for m in mounts]}))
        spec_path.chmod(0o600)
        with open(self.log_path, "ab") as log:
            log.write(f"--- localnode: starting {self.name} at {now_iso()}: {argv}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", pod.net.netns, sys.executable, LAUNCHER, str(spec_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        if self.started_at:
            self.restart_count += 1
        self.started_at, self.started_mono = now_iso(), now
        self.waiting, self.ready, self.kill_deadline = ("", ""), False, None
        self.probes = {kind: Probe(self.spec[kind], self.ports, now)
                       for kind in ("startupProbe", "livenessProbe", "readinessProbe")
                       if self.spec.get(kind)}
        self.started = "startupProbe" not in self.probes

    def _run_probes(self, now: float) -> None:
        pod, probes = self.pod, self.probes
        if (startup := probes.get("startupProbe")) and not self.started:
            if startup.due(now) and startup.run(pod.ip, self.pid, self.env):
                self.started = True
            elif startup.failures >= startup.failure_threshold:
                self.kill("startup probe failed")
            return
        if (live := probes.get("livenessProbe")) and live.due(now):
            live.run(pod.ip, self.pid, self.env)
            if live.failures >= live.failure_threshold:
                self.kill("liveness probe failed", live.spec.get("terminationGracePeriodSeconds"))
                return
        if (ready := probes.get("readinessProbe")) is None:
            self.ready = True
        elif ready.due(now):
            ready.run(pod.ip, self.pid, self.env)
            if ready.successes >= ready.success_threshold:
                self.ready = True
            elif ready.failures >= ready.failure_threshold:
                self.ready = False

    def kill(self, why: str = "", grace: float | None = None) -> None:
        """SIGTERM the container's process group now, SIGKILL once the grace period is over."""
        if self.proc is None or self.kill_deadline is not None:
            return
        if why:
            with open(self.log_path, "ab") as log:
                log.write(f"--- localnode: killing {self.name}: {why}\n".encode())
        grace = self.pod.grace if grace is None else float(grace)
        self.kill_deadline, self.ready = time.monotonic() + grace, False
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def _exited(self) -> bool:
        assert self.proc is not None
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None and info.si_pid != 0

    def _on_exit(self, now: float) -> None:
        assert self.proc is not None
        self._signal(signal.SIGKILL)  # what the main process left in its group
        code = self.proc.wait()
        code = 128 - code if code < 0 else code
        self.proc, self.ready = None, False
        state = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                 "startedAt": self.started_at, "finishedAt": now_iso()}
        self.last_state = {"terminated": state}
        policy = self.pod.obj["spec"].get("restartPolicy") or "Always"
        if self.pod.stopping or policy == "Never" or (policy == "OnFailure" and code == 0):
            self.done = {"terminated": state}
            return
        ran_for = now - self.started_mono
        backoff_base, backoff_cap = self.pod.node.backoff
        self.crashes = 1 if ran_for > 2 * backoff_cap else self.crashes + 1
        delay = min(backoff_cap, backoff_base * 2 ** (self.crashes - 1))
        self.next_start = now + delay
        self.waiting = ("CrashLoopBackOff", f"back-off {delay:g}s restarting failed container="
                        f"{self.name} pod={self.pod.name}")

    def status(self) -> Obj:
        """The container's entry in ``status.containerStatuses``."""
        if self.done is not None:
            state = self.done
        elif self.proc is not None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            reason, message = self.waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        return {"name": self.name, "ready": self.ready, "started": self.proc is not None
                and self.started, "restartCount": self.restart_count, "state": state,
                "lastState": self.last_state, "image": self.spec.get("image", "localnode"),
                "imageID": "", **({"containerID": f"localnode://{self.pid}"} if self.pid else {})}
