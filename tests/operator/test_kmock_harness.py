"""The kmock-based Kubernetes emulator carries the kubernetes client, kopf and kubectl."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from kmock_support import KubeEmulator, eventually, kube_emulator, run_operator
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parents[2]
NS, CR = "default", ("cleave.dev", "v1alpha1", "default", "llmservices")
KUBECTL = shutil.which("kubectl") or str(ROOT / ".tools/bin/kubectl")
LABELS = {"app": "web"}
POD = {"metadata": {"labels": LABELS}, "spec": {"containers": [{"name": "c", "image": "i:1"}]}}
DEPLOY = {"metadata": {"name": "web", "labels": LABELS},
          "spec": {"replicas": 1, "selector": {"matchLabels": LABELS}, "template": POD}}
LLM = {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "chat"},
       "spec": {"model": {"name": "m", "source": "m"}, "decode": {}, "kvStore": {"managed": {}}}}


@pytest.fixture()
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


def status_of(call: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(ApiException) as info:
        call()
    return info.value.status, json.loads(info.value.body)


def test_builtin_kinds_crud(emu: KubeEmulator) -> None:
    api = emu.api_client()
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    dep, code, _ = apps.create_namespaced_deployment_with_http_info(NS, DEPLOY)
    assert code == 201 and dep.metadata.uid and dep.metadata.generation == 1
    assert dep.metadata.creation_timestamp is not None
    core.create_namespaced_config_map(NS, {"metadata": {"name": "cfg", "labels": LABELS}})
    core.create_namespaced_secret(NS, {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    # As the API server does: stringData is folded into data (base64) and not kept.
    stored = core.read_namespaced_secret("s", NS)
    assert stored.data == {"k": "dg=="} and not stored.string_data
    core.create_namespaced_service(NS, {"metadata": {"name": "svc"}, "spec": {"ports": [
        {"port": 80}]}})
    apps.create_namespaced_stateful_set(NS, {**DEPLOY, "metadata": {"name": "db"}})
    core.create_namespaced_event(NS, {"metadata": {"name": "e1"}, "involvedObject": {
        "kind": "Deployment", "name": "web"}, "reason": "Test", "message": "hi"})
    code, body = status_of(lambda: core.create_namespaced_config_map(NS, {"metadata": {
        "name": "cfg"}}))
    assert (code, body["kind"], body["reason"]) == (409, "Status", "AlreadyExists")
    code, body = status_of(lambda: core.read_namespaced_secret("nope", NS))
    assert (code, body["kind"], body["reason"]) == (404, "Status", "NotFound")
    assert [c.metadata.name for c in core.list_namespaced_config_map(
        NS, label_selector="app in (web,api),!missing").items] == ["cfg"]
    assert not core.list_namespaced_config_map(NS, label_selector="app!=web").items

    # Strategic merge patch merges containers by name; the generation follows the spec only.
    rv1 = int(dep.metadata.resource_version)
    dep = apps.patch_namespaced_deployment("web", NS, {"spec": {"template": {"spec": {
        "containers": [{"name": "side", "image": "s:1"}]}}}})
    assert [c.name for c in dep.spec.template.spec.containers] == ["c", "side"]
    assert dep.metadata.generation == 2 and int(dep.metadata.resource_version) > rv1
    dep = apps.patch_namespaced_deployment("web", NS, {"metadata": {"labels": {"x": "y"}}},
                                           _content_type="application/merge-patch+json")
    assert dep.metadata.generation == 2 and dep.metadata.labels["x"] == "y"
    emu.set_status("deployments", NS, "web", {"readyReplicas": 1})
    assert apps.read_namespaced_deployment_status("web", NS).status.ready_replicas == 1
    scale = apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 4}})
    assert (scale.kind, scale.spec.replicas, scale.status.selector) == ("Scale", 4, "app=web")
    dep = apps.read_namespaced_deployment("web", NS)
    assert (dep.spec.replicas, dep.metadata.generation) == (4, 3)
    dep.spec.replicas = 2
    dep = apps.replace_namespaced_deployment("web", NS, dep)  # PUT
    assert dep.spec.replicas == 2 and dep.status.ready_replicas == 1
    dep.metadata.resource_version = "1"
    assert status_of(lambda: apps.replace_namespaced_deployment("web", NS, dep))[0] == 409

    # Garbage collection: dependents go when all of their owners are gone.
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": dep.metadata.uid}
    for name in ("child", "grandchild"):
        core.create_namespaced_config_map(NS, {"metadata": {"name": name, "ownerReferences": [
            owner]}})
        owner = {**owner, "apiVersion": "v1", "kind": "ConfigMap", "name": name,
                 "uid": emu.get("configmaps", NS, name)["metadata"]["uid"]}
    apps.delete_namespaced_deployment("web", NS)
    assert {o["metadata"]["name"] for o in emu.objects("configmaps", NS)} == {"cfg"}


def test_custom_resources_status_and_watch(emu: KubeEmulator) -> None:
    api = client.CustomObjectsApi(emu.api_client())
    obj = api.create_namespaced_custom_object(*CR, LLM)
    rv = obj["metadata"]["resourceVersion"]
    obj = api.patch_namespaced_custom_object_status(*CR, "chat", {"status": {"endpoint": "x"}})
    assert obj["status"]["endpoint"] == "x" and obj["metadata"]["generation"] == 1
    obj = api.patch_namespaced_custom_object(*CR, "chat", {"spec": {"router": {"port": 1}},
                                                           "status": {"endpoint": "ignored"}})
    assert obj["metadata"]["generation"] == 2 and obj["status"]["endpoint"] == "x"
    assert status_of(lambda: api.patch_namespaced_custom_object(*CR, "chat", {}, _content_type=(
        "application/strategic-merge-patch+json")))[0] == 415  # as for real custom resources
    api.delete_namespaced_custom_object(*CR, "chat")
    events = [(e["type"], e["object"]["metadata"].get("generation")) for e in watch.Watch().stream(
        api.list_namespaced_custom_object, *CR, resource_version=rv, timeout_seconds=1)]
    assert events == [("MODIFIED", 1), ("MODIFIED", 2), ("DELETED", 2)]
    assert api.list_namespaced_custom_object(*CR)["items"] == []


def test_kopf_operator(emu: KubeEmulator) -> None:
    registry, seen = kopf.OperatorRegistry(), []

    @kopf.on.create("cleave.dev", "v1alpha1", "llmservices", registry=registry)
    def created(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        cm = {"metadata": {"name": f"{body.meta.name}-cfg"}, "data": {"k": "v"}}
        kopf.adopt(cm, owner=body)
        client.CoreV1Api(emu.api_client()).create_namespaced_config_map(NS, cm)
        patch.status["endpoint"] = "http://chat:8000"

    @kopf.on.update("cleave.dev", "v1alpha1", "llmservices", registry=registry)
    def updated(diff: kopf.Diff, **_: Any) -> None:
        seen.append(("update", [d[1] for d in diff]))

    @kopf.on.delete("cleave.dev", "v1alpha1", "llmservices", registry=registry)
    def deleted(**_: Any) -> None:
        seen.append(("delete", []))

    api = client.CustomObjectsApi(emu.api_client())
    with run_operator(emu, registry):
        api.create_namespaced_custom_object(*CR, LLM)
        eventually(lambda: emu.get("configmaps", NS, "chat-cfg"))
        cr = eventually(lambda: (o := emu.get("llmservices", NS, "chat")) and
                        o.get("status", {}).get("endpoint") and o)
        assert cr["metadata"]["finalizers"] and cr["status"]["endpoint"] == "http://chat:8000"
        api.patch_namespaced_custom_object(*CR, "chat", {"spec": {"router": {"port": 9}}})
        eventually(lambda: seen == [("update", [("spec", "router")])])
        api.delete_namespaced_custom_object(*CR, "chat")
        eventually(lambda: not emu.objects("llmservices"))
        assert seen[-1] == ("delete", [])
        eventually(lambda: not emu.get("configmaps", NS, "chat-cfg"))


@pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl is not installed")
def test_kubectl(emu: KubeEmulator, tmp_path: Path) -> None:
    def kubectl(*args: str, stdin: str | None = None) -> str:
        cmd = [KUBECTL, "--server", emu.url, "--cache-dir", str(tmp_path), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=60)
        assert done.returncode == 0 and not done.stderr, done.stderr
        return done.stdout

    manifest = (ROOT / "examples" / "cpu-smollm2.yaml").read_text()
    assert "created" in kubectl("apply", "--validate=false", "-f", "-", stdin=manifest)
    more = manifest.replace("replicas: 1", "replicas: 2", 1)
    assert "configured" in kubectl("apply", "--validate=false", "-f", "-", stdin=more)
    listed = json.loads(kubectl("get", "llmservices", "-o", "json"))
    assert [(i["metadata"]["generation"], i["spec"]["prefill"]["replicas"])
            for i in listed["items"]] == [(2, 2)]
    assert "smollm2" in kubectl("get", "llms")
    kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(
        {"apiVersion": "apps/v1", "kind": "Deployment", **DEPLOY}))
    kubectl("scale", "deployment/web", "--replicas=3")
    assert kubectl("get", "deploy", "-l", "app=web", "-o", "jsonpath={..replicas}") == "3"
    kubectl("delete", "llmservice", "smollm2")
    assert not emu.objects("llmservices")
