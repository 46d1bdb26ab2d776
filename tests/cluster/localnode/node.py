"""The local node: kubelet, workload controllers, kube-proxy/CoreDNS for the API emulator.

One background thread polls the API every ``period`` seconds: it binds unassigned Pods to
the node, starts a :class:`PodRuntime` for every Pod bound here and stops those whose object
is gone, writes each Pod's status, recomputes Service DNS (hosts files of every pod), then
runs the Deployment/StatefulSet controllers. Helpers for tests work from the root namespace.
"""

from __future__ import annotations

import contextlib
import shutil
import stat
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from . import dns, network, scheduling
from .api import Api
from .apiproxy import ApiProxy
from .controllers import Controllers, Terminating, is_ready, owner_of
from .pods import PodRuntime
from .volumes import MountPoints

Obj = dict[str, Any]
NODE_NAME = "localnode"
API_PORT = 443  # what the in-cluster ``kubernetes`` Service says


class Emulator(Protocol):
    url: str


class LocalNode:
    def __init__(self, emu: Emulator, claims: dict[str, Path] | None = None,
                 workdir: Path | None = None, backoff: tuple[float, float] = (1.0, 30.0),
                 period: float = 0.25, users: dict[int, str] | None = None,
                 image_env: dict[str, str] | None = None) -> None:
        """``claims``: PersistentVolumeClaim name -> host dir. ``backoff``: a crashed
        container's first restart delay and the cap (doubling in between; the kubelet's are
        10 s and 300 s). ``users``: uid -> name, added to /etc/passwd in pods, as an image
        would have them (kopf, for one, fails for a uid without an entry). ``image_env``:
        what the image's ENV lines set (a pod's own env wins)."""
        self.image_env = dict(image_env or {})
        self.api, self.claims, self.backoff, self.period = Api(emu.url), claims or {}, \
            backoff, period
        self.workdir = Path(workdir) if workdir else Path()  # start() makes one if not given
        self._made_workdir: Path | None = None  # what close() removes
        self.host_ip, self.api_endpoint = str(network.GATEWAY), (str(network.GATEWAY), API_PORT)
        self.mount_points = MountPoints()
        self.reveal = _reveal()
        # What stands in for the image: the project (its venv, its editable sources) and the
        # Python it runs on. A pod volume mounted over one of them (an emptyDir at /tmp over
        # a checkout in /tmp) must not hide it: the launcher binds it back, read-only.
        self.image_paths = sorted({str(p) for p in (
            Path(__file__).resolve().parents[3], Path(sys.prefix).resolve(),
            Path(sys.base_prefix).resolve())})
        self.passwd = None if not users else Path("/etc/passwd").read_text() + "".join(
            f"{name}:x:{uid}:{uid}::/:/bin/sh\n" for uid, name in users.items())
        self.controllers = Controllers(self.api, NODE_NAME)
        self.runtimes: dict[str, PodRuntime] = {}  # by pod uid
        self._completed: set[str] = set()
        self._next_n = 2
        self._records: list[dns.Record] = []
        self._service_ips: dict[tuple[str, str], list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="localnode")
        self._lock_file: Any = None
        self._upstream = urllib.parse.urlsplit(emu.url)
        self._proxy: ApiProxy | None = None
        self.ca_path = Path()
        self.errors: list[str] = []

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Check the machine, clean up after a crashed node, then make the bridge, the API
        proxy and the workdir (under /var/tmp: pods mount their own /tmp) and start polling."""
        self._lock_file = network.preflight()  # raises before anything is made
        try:
            network.remove_leftovers()
            if self.workdir == Path():
                self.workdir = self._made_workdir = Path(
                    tempfile.mkdtemp(prefix="cleave-localnode-", dir="/var/tmp"))
            for sub in ("logs", "pods", "volumes"):
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            network.bridge_up()
            self._proxy = ApiProxy(self.host_ip, API_PORT, (
                self._upstream.hostname or "127.0.0.1", self._upstream.port or 80), self.workdir)
            self.ca_path = self._proxy.ca_path
            self._proxy.start()
            self._thread.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every pod (each with its grace period, in parallel), then remove the bridge,
        every netns/veth/hosts dir, the mount points made for pods and the workdir."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        for rt in list(self.runtimes.values()):
            rt.stop()
        for rt in list(self.runtimes.values()):
            rt.thread.join(rt.grace + 10)
        if self._proxy is not None:
            self._proxy.stop()
        if self._lock_file is None:
            return  # never started (or another node's): leave the network alone
        network.bridge_down()
        network.remove_leftovers()
        self.mount_points.remove()
        if self._made_workdir is not None:
            shutil.rmtree(self._made_workdir, ignore_errors=True)
        network.LOCK_PATH.unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:
                self.log(f"reconcile failed:\n{traceback.format_exc()}")
            self._stop.wait(self.period)

    def log(self, message: str) -> None:
        self.errors.append(message)
        with open(self.workdir / "logs" / "node.log", "a") as f:
            f.write(message + "\n")

    # -- one pass ---------------------------------------------------------------------------

    def reconcile(self) -> None:
        pods = self._sync_pods(self.api.list("pods"))
        self._update_dns(pods, self.api.list("services"))
        going = [Terminating(rt.namespace, rt.name, owner_of(rt.obj), rt.obj["metadata"].get(
            "labels") or {}) for rt in self.runtimes.values() if rt.stopping]
        self.controllers.reconcile(self.api.list("deployments"), self.api.list("statefulsets"),
                                   pods, going)

    def _sync_pods(self, pods: list[Obj]) -> list[Obj]:
        """The kubelet's part: start, stop and report pods; returns the live pods with the
        statuses just written, and the pods no node can take (Pending, unbound): the
        controllers count those too, as a ReplicaSet does, or they would add one every pass."""
        live: dict[str, Obj] = {}
        unbound: list[Obj] = []
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            if not spec.get("nodeName"):  # the scheduler's part: one node to filter
                if reason := scheduling.unfit(spec, NODE_NAME):
                    status = scheduling.pending_status(reason)
                    if pod.get("status") != status:
                        pod = self.api.put_status("pods", pod, status) or pod
                    if not meta.get("deletionTimestamp"):
                        unbound.append(pod)
                    continue
                bound = self.api.patch("pods", meta["namespace"], meta["name"],
                                       {"spec": {"nodeName": NODE_NAME}})
                pod = bound or pod
            if pod["spec"].get("nodeName") == NODE_NAME and not meta.get("deletionTimestamp"):
                live[meta["uid"]] = pod
        for uid, pod in live.items():
            if uid not in self.runtimes and uid not in self._completed:
                self.runtimes[uid] = rt = PodRuntime(self, pod, self._next_n)
                self._next_n += 1
                rt.start()
        for uid, rt in list(self.runtimes.items()):
            if uid not in live:
                rt.stop()
            elif (status := rt.status()) != live[uid].get("status"):
                live[uid] = self.api.put_status("pods", live[uid], status) or live[uid]
            if rt.finished:
                del self.runtimes[uid]
                self._completed.add(uid)
        return list(live.values()) + unbound

    def _update_dns(self, pods: list[Obj], services: list[Obj]) -> None:
        """Recompute Service names (see ``dns``); rewrite every pod's hosts file on change."""
        found, self._service_ips = dns.records(pods, services, self.host_ip)
        if found != self._records:
            self._records = found
            for rt in list(self.runtimes.values()):
                rt.write_hosts()

    def hosts_for(self, rt: PodRuntime) -> str:
        own = [rt.hostname]
        if sub := rt.obj["spec"].get("subdomain"):
            own.insert(0, f"{rt.hostname}.{sub}.{rt.namespace}.svc.cluster.local")
        return network.hosts_file(rt.ip, own, dns.hosts_lines(self._records, rt.namespace))

    # -- what pods need from the node -----------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        return self.api.get(resource, namespace, name)

    def automount(self, pod: Obj) -> bool:
        if (flag := pod["spec"].get("automountServiceAccountToken")) is not None:
            return bool(flag)
        sa = self.get("serviceaccounts", pod["metadata"]["namespace"],
                      pod["spec"].get("serviceAccountName") or "default")
        return bool((sa or {}).get("automountServiceAccountToken", True))

    # -- helpers for tests ------------------------------------------------------------------

    def service_ips(self, name: str, namespace: str = "default") -> list[str]:
        """The IPs a Service's names resolve to in pods now (its ready pods)."""
        return list(self._service_ips.get((namespace, name), []))

    def service_url(self, name: str, namespace: str = "default", port: int | None = None,
                    scheme: str = "http") -> str:
        """``scheme://<ip>:<port>`` of one ready pod of the Service (port: its first)."""
        ips = self.service_ips(name, namespace)
        if not ips:
            raise LookupError(f"service {namespace}/{name} has no ready pod\n{self.dump()}")
        if port is None:
            svc = self.api.get("services", namespace, name) or {}
            port = int(((svc.get("spec") or {}).get("ports") or [{}])[0]["port"])
        return f"{scheme}://{ips[0]}:{port}"

    def wait_ready(self, kind: str, name: str, namespace: str = "default",
                   timeout: float = 30.0) -> Obj:
        """Wait until a Pod is Ready, or a Deployment/StatefulSet has exactly its replicas,
        all updated and ready, and none still terminating; returns the object."""
        resource = {"pod": "pods", "deployment": "deployments",
                    "statefulset": "statefulsets"}[kind.lower()]
        deadline, obj = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            obj = self.api.get(resource, namespace, name)
            if obj is not None and self._is_ready(resource, obj):
                return obj
            time.sleep(0.1)
        raise TimeoutError(f"{kind} {namespace}/{name} not ready after {timeout}s: "
                           f"{(obj or {}).get('status')}\n{self.dump()}")

    def _is_ready(self, resource: str, obj: Obj) -> bool:
        if resource == "pods":
            return is_ready(obj)
        status, meta = obj.get("status") or {}, obj["metadata"]
        want = 1 if obj["spec"].get("replicas") is None else int(obj["spec"]["replicas"])
        going = [rt for rt in list(self.runtimes.values())
                 if rt.stopping and owner_of(rt.obj) == meta["uid"]]
        return (status.get("observedGeneration", 0) >= meta.get("generation", 1) and not going
                and status.get("replicas") == status.get("readyReplicas") == want
                and status.get("updatedReplicas") == want)

    def processes(self) -> list[int]:
        """Live pids of every pod's containers (running or terminating), from the root ns."""
        return sorted({pid for rt in list(self.runtimes.values()) for pid in rt.pids()})

    def netns(self) -> list[str]:
        """The network namespaces of this node's pods that exist now."""
        return [line.split()[0] for line in network.ip("netns", "list").splitlines()
                if line.startswith(f"{network.PREFIX}-")]

    def logs(self, pod: str, container: str | None = None, namespace: str = "default") -> str:
        """Everything the pod's containers (or one of them) wrote, every run of them."""
        pattern = f"{namespace}_{pod}_{container or '*'}.log"
        return "".join(p.read_text(errors="replace")
                       for p in sorted((self.workdir / "logs").glob(pattern)))

    def mint_token(self, namespace: str, service_account: str) -> str:
        """A new token for a ServiceAccount, known to the API proxy only."""
        assert self._proxy is not None
        return self._proxy.tokens.mint(namespace, service_account)

    def dump(self, lines: int = 30) -> str:
        """Every pod's state and the tail of each container log: print it when a test fails."""
        out = [f"=== localnode {self.workdir}", *self.errors[-5:]]
        if self._proxy is not None:
            out += [f"RBAC denied: {d}" for d in list(self._proxy.denied)[-10:]]
        for rt in list(self.runtimes.values()):
            states = {c["name"]: (c["state"], c["restartCount"], c["ready"])
                      for c in rt.status()["containerStatuses"]}
            out.append(f"pod {rt.namespace}/{rt.name} ip={rt.ip} stopping={rt.stopping} "
                       f"{rt.unschedulable or rt.sandbox_error} {states}")
        out += self._api_side()
        for path in sorted((self.workdir / "logs").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out += [f"--- {path.name}", *tail]
        return "\n".join(out)

    def _api_side(self) -> list[str]:
        """What the API holds that the node's runtimes do not show: each Deployment's and
        StatefulSet's replicas, and the pods not running here (pending, unbound)."""
        try:
            workloads = self.api.list("deployments") + self.api.list("statefulsets")
            pods = self.api.list("pods")
        except Exception as e:  # the dump must not hide the failure it reports
            return [f"(API unreadable: {e})"]
        out = []
        for w in workloads:
            status = {k: v for k, v in (w.get("status") or {}).items() if k != "conditions"}
            out.append(f"{w.get('kind', 'workload')} {w['metadata']['namespace']}/"
                       f"{w['metadata']['name']} spec.replicas={w['spec'].get('replicas')} "
                       f"status={status}")
        here = {rt.obj["metadata"]["uid"] for rt in self.runtimes.values()}
        out += [f"pod (not running here) {p['metadata']['namespace']}/{p['metadata']['name']} "
                f"node={p['spec'].get('nodeName')} status={p.get('status')}"
                for p in pods if p["metadata"]["uid"] not in here]
        return out


def _reveal() -> tuple[str, list[str]] | None:
    """Where the interpreter lies under a directory other users cannot enter (pyenv under
    /root), the launcher must bind it back into a tmpfs for pods with a non-root user."""
    keep = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
    for parent in reversed(keep[0].parents):
        if not parent.stat().st_mode & stat.S_IXOTH:
            return str(parent), [str(k) for k in keep if k.is_relative_to(parent)]
    return None


@contextlib.contextmanager
def local_node(emu: Emulator, claims: dict[str, Path] | None = None,
               workdir: Path | None = None, **options: Any) -> Iterator[LocalNode]:
    """Run a :class:`LocalNode` for the emulator ``emu``; stop and clean up all on exit."""
    node = LocalNode(emu, claims, workdir, **options)
    try:
        node.start()
        yield node
    finally:
        node.close()


