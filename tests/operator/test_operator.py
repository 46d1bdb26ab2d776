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
            ("services", "chat-redis"), ("secrets", "chat-redis-users"),
            ("secrets", "chat-kv-salt"), ("poddisruptionbudgets", "chat-prefill"),
            ("poddisruptionbudgets", "chat-decode"), ("poddisruptionbudgets", "chat-router"),
            ("secrets", "chat-internal-token"), ("networkpolicies", "chat-workers"),
            ("networkpolicies", "chat-redis")}


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
    for kind in ("deployments", "services", "configmaps", "statefulsets", "secrets",
                 "poddisruptionbudgets", "networkpolicies"):
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
    password = emu.get("secrets", NS, "chat-redis-users")
    client.AppsV1Api(emu.api_client()).patch_namespaced_deployment(
        "chat-router", NS, {"spec": {"replicas": 7}},
        _content_type="application/merge-patch+json")
    third = reconcile(kube, cr(emu))
    assert third.actions == [("patched", "Deployment/chat-router")]
    assert emu.get("secrets", NS, "chat-redis-users") == password


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


def test_creation_event_builds_all_children(emu: KubeEmulator,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of 20 services created back to back gets all its children from its creation
    event, with the periodic recheck set far out (a dropped or failed create handler would
    leave them to that timer and fail here). The time is printed, not bounded: speed belongs
    to benchmarks."""
    recheck = 60.0
    monkeypatch.setenv("CLEAVE_RECHECK_SECONDS", str(recheck))  # read when run_operator loads
    objects = client.CustomObjectsApi(emu.api_client())
    times = []
    with run_operator(emu, module="cleave.operator.handlers"):
        for i in range(20):
            name = f"svc{i}"
            expected = {(k, n.replace("chat", name)) for k, n in CHILDREN}
            start = time.perf_counter()
            objects.create_namespaced_custom_object(*CR, service(name))
            eventually(lambda name=name, expected=expected: present(emu, name) == expected,
                       timeout=recheck)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"\ncreation to all children: median {median * 1e3:.0f} ms over 20 (emulator)")
    assert max(times) < recheck / 2, times


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


def test_children_no_longer_desired_are_pruned(emu: KubeEmulator) -> None:
    """Removing a role, or switching from managed to external Redis, used to leave the old
    children running."""
    objects = client.CustomObjectsApi(emu.api_client())
    objects.create_namespaced_custom_object(*CR, service())
    kube = Kube(emu.api_client())
    reconcile(kube, cr(emu))
    assert present(emu) == CHILDREN
    unrelated = {"apiVersion": "v1", "kind": "ConfigMap",  # same labels, another owner
                 "metadata": {"name": "chat-mine", "namespace": NS,
                              "labels": {"app.kubernetes.io/instance": "chat"}}}
    client.CoreV1Api(emu.api_client()).create_namespaced_config_map(NS, unrelated)
    objects.patch_namespaced_custom_object(
        *CR, "chat", {"spec": {"prefill": None, "kvStore": {
            "managed": None, "external": {"url": "redis://cache.infra:6379/0"}}}})
    outcome = reconcile(kube, cr(emu))
    gone = {("deployments", "chat-prefill"), ("services", "chat-prefill"),
            ("statefulsets", "chat-redis"), ("services", "chat-redis"),
            ("poddisruptionbudgets", "chat-prefill"), ("networkpolicies", "chat-redis")}
    kinds = {"deployments": "Deployment", "services": "Service", "statefulsets": "StatefulSet",
             "secrets": "Secret", "poddisruptionbudgets": "PodDisruptionBudget",
             "networkpolicies": "NetworkPolicy"}
    assert {a for a in outcome.actions if a[0] == "deleted"} == {
        ("deleted", f"{kinds[k]}/{n}") for k, n in gone}
    # The Redis password Secret stays until the LLMService goes: the operator may not list
    # Secrets (least privilege), so it never prunes one.
    assert present(emu) == (CHILDREN - gone) | {("configmaps", "chat-mine")}
    assert ("secrets", "chat-redis-users") in present(emu)
    assert reconcile(kube, cr(emu)).actions == []  # settled


def test_an_hpa_on_the_router_takes_its_replicas_over(emu: KubeEmulator) -> None:
    """How a user hands the router's (or a fixed role's) replicas to an HPA or KEDA: create
    one whose scaleTargetRef names the Deployment; the operator stops writing them."""
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, service())
    kube = Kube(emu.api_client())
    reconcile(kube, cr(emu))
    client.AutoscalingV2Api(emu.api_client()).create_namespaced_horizontal_pod_autoscaler(
        NS, {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
             "metadata": {"name": "router-hpa", "namespace": NS},
             "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                         "name": "chat-router"},
                      "minReplicas": 1, "maxReplicas": 5}})
    client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
        "chat-router", NS, {"spec": {"replicas": 4}})  # the HPA scales it
    assert reconcile(kube, cr(emu)).actions == []
    assert emu.get("deployments", NS, "chat-router")["spec"]["replicas"] == 4
    client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
        "chat-decode", NS, {"spec": {"replicas": 4}})  # no HPA: the spec's count comes back
    assert reconcile(kube, cr(emu)).actions == [("patched", "Deployment/chat-decode")]


def test_the_charts_runtime_image_reaches_services_that_set_none(
        emu: KubeEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.image (the operator's CLEAVE_RUNTIME_IMAGE) had no effect: the CRD defaulted
    spec.image, so the operator's fallback never ran and a chart upgrade rolled nothing."""
    def images() -> set[str]:
        return {d["spec"]["template"]["spec"]["containers"][0]["image"]
                for d in emu.objects("deployments", NS)}

    objects = client.CustomObjectsApi(emu.api_client())
    objects.create_namespaced_custom_object(*CR, service())  # the example sets no image
    kube = Kube(emu.api_client())
    monkeypatch.setenv("CLEAVE_RUNTIME_IMAGE", "registry.example.com/cleave-runtime:1")
    reconcile(kube, cr(emu))
    assert images() == {"registry.example.com/cleave-runtime:1"}
    monkeypatch.setenv("CLEAVE_RUNTIME_IMAGE", "registry.example.com/cleave-runtime:2")
    outcome = reconcile(kube, cr(emu))  # the chart upgraded: every workload rolls
    assert {a for a in outcome.actions if a[1].startswith("Deployment/")} == {
        ("patched", f"Deployment/chat-{r}") for r in ("prefill", "decode", "router")}
    assert images() == {"registry.example.com/cleave-runtime:2"}
    objects.patch_namespaced_custom_object(*CR, "chat", {"spec": {"image": "mine:3"}})
    reconcile(kube, cr(emu))
    assert images() == {"mine:3"}  # a service's own image wins


def test_a_pod_field_the_spec_changes_or_drops_leaves_the_pods(emu: KubeEmulator) -> None:
    """A merge patch merges maps and keeps keys it does not mention: a changed nodeSelector
    used to keep its old label too (pods unschedulable), a dropped affinity stayed."""
    objects = client.CustomObjectsApi(emu.api_client())
    obj = service()
    obj["spec"]["decode"] = {"replicas": 1, "nodeSelector": {"gpu": "h200"},
                             "priorityClassName": "inference", "affinity": {"nodeAffinity": {
                                 "preferredDuringSchedulingIgnoredDuringExecution": []}}}
    objects.create_namespaced_custom_object(*CR, obj)
    kube = Kube(emu.api_client())
    reconcile(kube, cr(emu))

    def pod_spec() -> dict[str, Any]:
        return dict(emu.get("deployments", NS, "chat-decode")["spec"]["template"]["spec"])

    assert pod_spec()["nodeSelector"] == {"gpu": "h200"}
    assert "affinity" not in emu.get("deployments", NS, "chat-router")["spec"]["template"][
        "spec"]  # created without the nulls
    objects.patch_namespaced_custom_object(*CR, "chat", {"spec": {"decode": {
        "nodeSelector": {"gpu": None, "pool": "cpu"}, "priorityClassName": None,
        "affinity": None}}})
    assert reconcile(kube, cr(emu)).actions == [("patched", "Deployment/chat-decode")]
    assert pod_spec()["nodeSelector"] == {"pool": "cpu"}
    assert pod_spec().get("priorityClassName") is None and pod_spec().get("affinity") is None
    assert reconcile(kube, cr(emu)).actions == []  # settled


def test_a_secret_the_spec_names_is_never_pruned(emu: KubeEmulator) -> None:
    """Pinning the generated salt by naming <name>-kv-salt in saltSecret must not delete it
    (every worker would then fail to start)."""
    objects = client.CustomObjectsApi(emu.api_client())
    objects.create_namespaced_custom_object(*CR, service())
    kube = Kube(emu.api_client())
    reconcile(kube, cr(emu))
    salt = emu.get("secrets", NS, "chat-kv-salt")
    objects.patch_namespaced_custom_object(*CR, "chat", {"spec": {"kvStore": {
        "saltSecret": {"name": "chat-kv-salt", "key": "salt"}}}})
    outcome = reconcile(kube, cr(emu))
    assert not [a for a in outcome.actions if a[0] == "deleted"]
    assert emu.get("secrets", NS, "chat-kv-salt") == salt
