"""The operator, run by kopf against the Kubernetes API emulator: create, update, status,
delete, and idle reconciles that write nothing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock_support import KubeEmulator, eventually, operator_emulator, run_operator
from kubernetes import client

from cleave.operator.kube import Kube
from cleave.operator.reconcile import reconcile

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
CR = ("cleave.dev", "v1alpha1", NS, "llmservices")
CHILDREN = {("deployments", "chat-decode"), ("deployments", "chat-prefill"),
            ("deployments", "chat-router"), ("services", "chat-router"),
            ("services", "chat-decode"), ("services", "chat-prefill"),
            ("configmaps", "chat-config"), ("statefulsets", "chat-redis"),
            ("services", "chat-redis"), ("secrets", "chat-redis-auth")}


def service(name: str = "chat") -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["prefill"] = {"replicas": 1}
    doc["spec"]["decode"] = {"replicas": 1}
    doc["spec"]["kvStore"] = {"managed": {}}
    return dict(doc)


@pytest.fixture()
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeEmulator]:
    monkeypatch.setenv("CLEAVE_RECHECK_SECONDS", "0.5")
    with operator_emulator() as emulator:
        yield emulator


def present(emu: KubeEmulator, name: str = "chat") -> set[tuple[str, str]]:
    found = set()
    for kind in ("deployments", "services", "configmaps", "statefulsets", "secrets"):
        for obj in emu.objects(kind, NS):
            if obj["metadata"]["name"].startswith(name + "-"):
                found.add((kind, obj["metadata"]["name"]))
    return found


def cr(emu: KubeEmulator, name: str = "chat") -> dict[str, Any]:
    return dict(emu.get("llmservices", NS, name))


def test_lifecycle_create_update_status_delete(emu: KubeEmulator) -> None:
    objects = client.CustomObjectsApi(emu.api_client())
    with run_operator(emu, module="cleave.operator.handlers"):
        created = objects.create_namespaced_custom_object(*CR, service())
        uid = created["metadata"]["uid"]
        eventually(lambda: present(emu) == CHILDREN)
        for kind, name in CHILDREN:
            [owner] = emu.get(kind, NS, name)["metadata"]["ownerReferences"]
            assert owner["uid"] == uid and owner["kind"] == "LLMService" and owner["controller"]
        status = eventually(lambda: cr(emu).get("status", {}).get("observedGeneration") == 1
                            and cr(emu)["status"])
        assert status["endpoint"] == "http://chat-router.default.svc:8000/v1"
        # What the operator did is told as Kubernetes Events on the LLMService.
        def told() -> set[str]:
            return {e["message"] for e in emu.objects("events", NS)
                    if e.get("involvedObject", {}).get("uid") == uid}

        eventually(lambda: {"created Deployment/chat-decode",
                            "created Service/chat-router"} <= told())
        ready = {c["type"]: c for c in cr(emu)["status"]["conditions"]}["Ready"]
        assert (ready["status"], ready["reason"]) == ("False", "PodsNotReady")

        # Update: children follow, observedGeneration follows.
        objects.patch_namespaced_custom_object(*CR, "chat", {"spec": {"decode": {"replicas": 3}}})
        eventually(lambda: emu.get("deployments", NS, "chat-decode")["spec"]["replicas"] == 3)
        eventually(lambda: cr(emu)["status"]["observedGeneration"] == 2)

        # Pods waiting for GPUs are told apart from pods that are merely starting.
        client.CoreV1Api(emu.api_client()).create_namespaced_pod(NS, {
            "metadata": {"name": "chat-decode-x", "labels": {
                "app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": "chat",
                "app.kubernetes.io/component": "decode",
                "app.kubernetes.io/managed-by": "cleave-operator"}},
            "spec": {"containers": [{"name": "decode", "image": "x"}]}})
        emu.set_status("pods", NS, "chat-decode-x", {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]})
        eventually(lambda: {c["type"]: c["reason"] for c in cr(emu)["status"]["conditions"]}
                   ["Ready"] == "PodsPendingForGPU")

        # A controller reports every role ready: the service turns Ready.
        client.CoreV1Api(emu.api_client()).delete_namespaced_pod("chat-decode-x", NS)
        for role, n in (("prefill", 1), ("decode", 3), ("router", 1)):
            emu.set_status("deployments", NS, f"chat-{role}", {"readyReplicas": n,
                                                               "replicas": n})
        eventually(lambda: {c["type"]: c["status"] for c in cr(emu)["status"]["conditions"]}
                   ["Ready"] == "True")
        assert cr(emu)["status"]["decode"] == {"desiredReplicas": 3, "readyReplicas": 3}

        # Idle: with nothing changing, rechecks (every 0.5 s here) write nothing at all.
        writes = emu.call(lambda: len(emu.handler.log))
        time.sleep(2.5)
        assert emu.call(lambda: len(emu.handler.log)) == writes



def test_deleting_a_service_deletes_its_children(emu: KubeEmulator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # With rechecks on, kopf holds a finalizer on the service and releases it on deletion.
    monkeypatch.setenv("CLEAVE_RECHECK_SECONDS", "0.5")
    objects = client.CustomObjectsApi(emu.api_client())
    with run_operator(emu, module="cleave.operator.handlers"):
        objects.create_namespaced_custom_object(*CR, service())
        eventually(lambda: present(emu) == CHILDREN)
        objects.delete_namespaced_custom_object(*CR, "chat")
        eventually(lambda: not present(emu))


def test_invalid_spec_is_reported_not_crashed_on(emu: KubeEmulator) -> None:
    bad = service("broken")
    bad["spec"]["decode"] = {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}
    with run_operator(emu, module="cleave.operator.handlers"):
        client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, bad)
        conditions = eventually(lambda: cr(emu, "broken").get("status", {}).get("conditions"))
        degraded = {c["type"]: c for c in conditions}["Degraded"]
        assert degraded["status"] == "True" and "minReplicas 5 > maxReplicas 2" in \
            degraded["message"]
        assert not present(emu, "broken")


def test_an_idle_reconcile_makes_no_api_writes(emu: KubeEmulator) -> None:
    objects = client.CustomObjectsApi(emu.api_client())
    objects.create_namespaced_custom_object(*CR, service())
    kube = Kube(emu.api_client())
    first = reconcile(kube, cr(emu))
    assert len(first.actions) == len(CHILDREN) and kube.writes == len(CHILDREN)
    kube.patch_status(NS, "chat", first.status)
    writes = kube.writes
    second = reconcile(kube, cr(emu))
    assert second.actions == [] and kube.writes == writes  # zero writes when nothing changed
    assert second.status == cr(emu)["status"]  # and no status patch would be needed
    # A child edited by hand is put back; the password Secret is never regenerated.
    password = emu.get("secrets", NS, "chat-redis-auth")
    client.AppsV1Api(emu.api_client()).patch_namespaced_deployment(
        "chat-router", NS, {"spec": {"replicas": 7}},
        _content_type="application/merge-patch+json")
    third = reconcile(kube, cr(emu))
    assert third.actions == [("patched", "Deployment/chat-router")]
    assert emu.get("secrets", NS, "chat-redis-auth") == password


def test_external_autoscaling_leaves_replicas_alone(emu: KubeEmulator) -> None:
    obj = service()
    obj["spec"]["autoscaling"] = {"mode": "External"}
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, obj)
    kube = Kube(emu.api_client())
    reconcile(kube, cr(emu))
    client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
        "chat-decode", NS, {"spec": {"replicas": 6}})  # an HPA scales the role
    outcome = reconcile(kube, cr(emu))
    assert ("patched", "Deployment/chat-decode") not in outcome.actions
    assert emu.get("deployments", NS, "chat-decode")["spec"]["replicas"] == 6


def test_time_from_creation_to_all_children(emu: KubeEmulator) -> None:
    objects = client.CustomObjectsApi(emu.api_client())
    times = []
    with run_operator(emu, module="cleave.operator.handlers"):
        for i in range(20):
            name = f"svc{i}"
            expected = {(k, n.replace("chat", name)) for k, n in CHILDREN}
            start = time.perf_counter()
            objects.create_namespaced_custom_object(*CR, service(name))
            eventually(lambda name=name, expected=expected: present(emu, name) == expected)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"\ncreation to all children: median {median * 1e3:.0f} ms over 20 (emulator)")
    assert median < 5.0


def test_kubectl_apply_of_every_example_reaches_the_operator(emu: KubeEmulator,
                                                             tmp_path: Path) -> None:
    import json
    import shutil
    import subprocess

    kubectl_bin = shutil.which("kubectl") or str(ROOT / ".tools/bin/kubectl")

    def kubectl(*args: str) -> str:
        return subprocess.run([kubectl_bin, "--server", emu.url, "--cache-dir", str(tmp_path),
                               *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout

    with run_operator(emu, module="cleave.operator.handlers"):
        for example in sorted((ROOT / "examples").glob("*.yaml")):
            assert "created" in kubectl("apply", "--validate=false", "-f", str(example))
        services = json.loads(kubectl("get", "llmservices", "-o", "json"))["items"]
        assert len(services) == 3
        for svc in services:
            name = svc["metadata"]["name"]
            eventually(lambda name=name: emu.get("deployments", NS, f"{name}-router"))
            eventually(lambda name=name: cr(emu, name).get("status", {}).get("endpoint"))
