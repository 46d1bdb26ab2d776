"""One pod on the node: its network namespace, volumes and containers, run by its own thread.

The thread plays the kubelet's pod worker: set up the sandbox (netns, volumes), start and
watch the containers (``Container.tick``), and on :meth:`stop` SIGTERM every container, wait
for the grace period (``terminationGracePeriodSeconds``, default 30), SIGKILL what is left
(also anything that escaped its process group but still runs in the netns), then remove the
netns, veth, hosts file and the pod's dir (logs stay, under the node's ``logs/``).
"""

from __future__ import annotations

import shutil
import stat
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .containers import Container, now_iso
from .env import ConfigError
from .network import PodNetwork, netns_pids
from .volumes import VolumeError, prepare, service_account

if TYPE_CHECKING:
    from .node import LocalNode

Obj = dict[str, Any]
TICK = 0.1


class PodRuntime:
    def __init__(self, node: LocalNode, obj: Obj, n: int) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        self.node, self.obj, self.uid = node, obj, meta["uid"]
        self.name, self.namespace = meta["name"], meta.get("namespace") or "default"
        self.hostname = spec.get("hostname") or self.name
        self.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.net = PodNetwork(n)
        self.ip = self.net.ip
        # Unique per pod object: a StatefulSet's pod of the same name may start as this goes.
        self.dir = node.workdir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.volumes: dict[str, Path] = {}
        self.sa_dir: Path | None = None
        self.unschedulable = ""  # why the pod cannot run here (it stays Pending)
        self.sandbox_error = ""  # why its sandbox is not set up yet
        self.network_up = self.stopping = self.finished = False
        self.start_time = ""
        self.final_status: Obj | None = None
        self.lock = threading.Lock()  # the hosts file: this thread creates it, the node rewrites
        self.containers = [Container(self, c) for c in spec.get("containers") or []]
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"pod-{self.name}")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Begin terminating (non-blocking); ``finished`` turns True once all is cleaned up."""
        self.stopping = True

    def pids(self) -> list[int]:
        found = {c.pid for c in self.containers if c.pid}
        if self.network_up:
            found.update(netns_pids(self.net.netns))
        return sorted(p for p in found if p)

    def security(self, container: Obj) -> Obj:
        """The launcher's user, groups and filesystem settings from the pod's and the
        container's securityContext (the container's wins). Raises ConfigError as the kubelet
        would for runAsNonRoot without a non-zero runAsUser (there is no image user)."""
        pod_sc = self.obj["spec"].get("securityContext") or {}
        sc = {**pod_sc, **(container.get("securityContext") or {})}
        uid, gid = int(sc.get("runAsUser") or 0), int(sc.get("runAsGroup") or 0)
        if sc.get("runAsNonRoot") and uid == 0:
            raise ConfigError("container has runAsNonRoot and image will run as root")
        groups = [int(g) for g in [*(pod_sc.get("supplementalGroups") or []),
                                   *([pod_sc["fsGroup"]] if pod_sc.get("fsGroup") else [])]]
        return {"uid": uid, "gid": gid, "groups": groups,
                "readOnlyRoot": bool(sc.get("readOnlyRootFilesystem")),
                "noNewPrivs": sc.get("allowPrivilegeEscalation") is False,
                "reveal": self.node.reveal if uid != 0 else None,
                "image": self.node.image_paths}

    def write_hosts(self) -> None:
        with self.lock:
            if self.network_up:
                self.net.write_hosts(self.node.hosts_for(self))

    def _run(self) -> None:
        try:
            if not self._setup():  # cannot run here: stay Pending until deleted
                while not self.stopping:
                    time.sleep(TICK)
            while not self.stopping:
                now = time.monotonic()
                for c in self.containers:
                    c.tick(now)
                if self.containers and all(c.done is not None for c in self.containers):
                    self.final_status = self.status()  # kept: podIP and all
                    break  # a pod that ran to completion (restartPolicy Never/OnFailure)
                time.sleep(TICK)
        except Exception:
            self.sandbox_error = traceback.format_exc(limit=3)
            self.node.log(f"pod {self.namespace}/{self.name} failed:\n{self.sandbox_error}")
        finally:
            self._teardown()

    def _setup(self) -> bool:
        """The sandbox; volumes are retried until their Secrets/ConfigMaps exist. False if
        the pod cannot run on this node."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(stat.S_IRWXU)  # the launch specs hold secrets
        if self.obj["spec"].get("initContainers"):
            self.unschedulable = "initContainers are not supported by the local node"
            return False
        while not self.stopping:
            try:
                self.volumes = prepare(self.obj, self.dir, self.node.get, self.node.claims,
                                       self.node.workdir / "volumes")
                break
            except VolumeError as e:
                self.sandbox_error = str(e)
                if e.unschedulable:
                    self.unschedulable = str(e)
                time.sleep(1.0)
        if self.stopping:
            return False
        self.sandbox_error = self.unschedulable = ""
        if self.node.automount(self.obj):
            self.sa_dir = service_account(self.obj, self.dir, self.node.ca_path,
                                          self.node.mint_token)
        with self.lock:
            self.net.create(self.node.hosts_for(self), self.node.passwd)
            self.network_up = True
        self.start_time = now_iso()
        return True

    def _teardown(self) -> None:
        self.stopping = True
        for c in self.containers:
            c.kill()
        deadline = time.monotonic() + self.grace + 5
        while any(c.proc for c in self.containers) and time.monotonic() < deadline:
            for c in self.containers:
                c.tick(time.monotonic())
            time.sleep(TICK / 2)
        with self.lock:
            if self.network_up:
                self.net.delete()  # also kills anything left in the netns
            self.network_up = False
        shutil.rmtree(self.dir, ignore_errors=True)
        self.finished = True

    def status(self) -> Obj:
        """The Pod's ``status`` as the kubelet would report it."""
        if self.final_status is not None:
            return self.final_status
        cs = [c.status() for c in self.containers]
        ready = bool(cs) and all(c["ready"] for c in cs)
        done = [c.done for c in self.containers if c.done is not None]
        if self.containers and len(done) == len(self.containers):
            failed = any(d["terminated"]["exitCode"] != 0 for d in done)
            phase = "Failed" if failed else "Succeeded"
        elif self.network_up and all(c.started_at for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        conditions = [
            _cond("PodScheduled", not self.unschedulable, "Unschedulable", self.unschedulable),
            _cond("Initialized", True), _cond("ContainersReady", ready, "ContainersNotReady"),
            _cond("Ready", ready, "ContainersNotReady")]
        status: Obj = {"phase": phase, "conditions": conditions, "hostIP": self.node.host_ip,
                       "containerStatuses": cs, "qosClass": "BestEffort"}
        if self.network_up:
            status.update(podIP=self.ip, podIPs=[{"ip": self.ip}], startTime=self.start_time)
        if self.sandbox_error and not self.unschedulable:
            for c in cs:
                c["state"] = {"waiting": {"reason": "ContainerCreating",
                                          "message": self.sandbox_error}}
        return status


def _cond(kind: str, ok: bool, reason: str = "", message: str = "") -> Obj:
    cond: Obj = {"type": kind, "status": "True" if ok else "False"}
    if not ok and reason:
        cond["reason"] = reason
    if not ok and message:
        cond["message"] = message
    return cond
