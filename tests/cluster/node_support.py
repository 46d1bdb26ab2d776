"""What the local node's test modules share: the emulator and node fixtures (a node per
module), and helpers to build workloads and read what pods printed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kmock_support import KubeEmulator, kube_emulator
from kubernetes import client
from localnode import LocalNode, local_node

T = TypeVar("T")
NS = "default"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models")
    (path / "weights.txt").write_text("the model\n")
    return path


@pytest.fixture(scope="module")
def node(emu: KubeEmulator, models: Path) -> Iterator[LocalNode]:
    with local_node(emu, claims={"models": models}, backoff=(0.5, 4.0),
                    users={10001: "app"}) as n:
        yield n
    assert not n.netns() and not list(Path("/etc/netns").glob("cln-*"))


@pytest.fixture(scope="module")
def core(emu: KubeEmulator) -> client.CoreV1Api:
    return client.CoreV1Api(emu.api_client())


@pytest.fixture(scope="module")
def apps(emu: KubeEmulator) -> client.AppsV1Api:
    return client.AppsV1Api(emu.api_client())


def until(node: LocalNode, fn: Callable[[], T], timeout: float = 60.0) -> T:
    """Poll ``fn`` until truthy; on timeout fail with the node's dump (pods, log tails).
    Generous: it costs nothing when ``fn`` comes true, and a loaded box is slow to start pods."""
    deadline = time.monotonic() + timeout
    while not (result := fn()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert result, f"{fn!r} stayed falsy for {timeout}s\n{node.dump()}"
    return result


def container(name: str, command: list[str], **extra: Any) -> Obj:
    return {"name": name, "image": "unused", "command": command, **extra}


def deployment(name: str, containers: list[Obj], replicas: int = 1, **spec: Any) -> Obj:
    labels = {"app": name}
    pod_spec = {"containers": containers, **spec.pop("pod", {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}, **spec}}


def run_pod(core: client.CoreV1Api, name: str, script: str, **spec: Any) -> None:
    """A bare pod that runs a python script once (restartPolicy Never)."""
    core.create_namespaced_pod(NS, {"metadata": {"name": name, "labels": {"check": name}},
                                    "spec": {"restartPolicy": "Never", "containers": [
                                        container("main", ["python", "-c", script],
                                                  **spec.pop("container", {}))], **spec}})


def pod_output(node: LocalNode, emu: KubeEmulator, name: str, phase: str = "Succeeded") -> Any:
    """Wait for a run_pod pod to finish; the JSON it printed last."""
    until(node, lambda: (emu.get("pods", NS, name) or {}).get("status", {}).get("phase")
          in ("Succeeded", "Failed"))
    pod = emu.get("pods", NS, name)
    assert pod and pod["status"]["phase"] == phase, node.dump()
    lines = [line for line in node.logs(name).splitlines() if not line.startswith("--- ")]
    assert lines, node.dump()
    return json.loads(lines[-1])


def pods_of(emu: KubeEmulator, app: str) -> list[Obj]:
    return [p for p in emu.objects("pods", NS) if p["metadata"]["labels"].get("app") == app]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


HTTP_SERVER = ["python", "-m", "http.server", "--bind", "0.0.0.0", "8100"]
READY_HTTP = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
