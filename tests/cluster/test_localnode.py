"""The local node runs workloads of the API emulator as real processes, one netns per pod.

Real processes throughout: http.server, redis-server, python one-liners resolving Service
names, an in-cluster kubernetes client through the TLS API proxy and its RBAC. Pods that run a
check to completion (restartPolicy Never) print JSON, which the tests read from the node's logs.
"""

from __future__ import annotations

import itertools
import re
import time
import urllib.request
from pathlib import Path

from kmock_support import KubeEmulator
from kubernetes import client
from localnode import LocalNode
from node_support import (
    HTTP_SERVER,
    NS,
    READY_HTTP,
    Obj,
    alive,
    container,
    deployment,
    pod_output,
    pods_of,
    run_pod,
    until,
)

RESOLVE = """
import json, socket
names = ["web", "web.default", "web.default.svc", "web.default.svc.cluster.local"]
print(json.dumps({n: sorted({a[4][0] for a in socket.getaddrinfo(n, 8100, type=socket.SOCK_STREAM)})
                  for n in names}))
"""


def test_deployment_pods_dns_scale_and_delete(node: LocalNode, emu: KubeEmulator,
                                              core: client.CoreV1Api,
                                              apps: client.AppsV1Api) -> None:
    web = container("web", HTTP_SERVER, ports=[{"name": "http", "containerPort": 8100}],
                    readinessProbe=READY_HTTP)
    dep = apps.create_namespaced_deployment(NS, deployment("web", [web], replicas=2))
    core.create_namespaced_service(NS, {"metadata": {"name": "web"}, "spec": {
        "clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8100}]}})
    status = node.wait_ready("deployment", "web")["status"]
    assert (status["readyReplicas"], status["availableReplicas"], status["updatedReplicas"],
            status["observedGeneration"]) == (2, 2, 2, 1)
    pods = pods_of(emu, "web")
    ips = sorted(p["status"]["podIP"] for p in pods)
    assert len(pods) == 2 and len(set(ips)) == 2 and all(ip.startswith("10.244.") for ip in ips)
    for pod in pods:
        meta = pod["metadata"]
        assert re.fullmatch(rf"web-{meta['labels']['pod-template-hash']}-[a-z0-9]{{5}}",
                            meta["name"])
        assert meta["ownerReferences"][0]["uid"] == dep.metadata.uid
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"]
        assert pod["status"]["phase"] == "Running" and ready == "True"
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8100/", timeout=5) as r:
            assert r.status == 200  # same port in both pods: each in its own netns
    assert node.service_ips("web") == ips
    # From inside another pod: every name form of the headless Service gives both pods.
    run_pod(core, "resolver", RESOLVE)
    assert pod_output(node, emu, "resolver") == {
        n: ips for n in ("web", "web.default", "web.default.svc", "web.default.svc.cluster.local")}

    apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    node.wait_ready("deployment", "web")
    until(node, lambda: len(pods_of(emu, "web")) == 1 and len(node.service_ips("web")) == 1)
    until(node, lambda: len(node.processes()) == 1)  # the other pod's process is gone
    pids = node.processes()

    apps.delete_namespaced_deployment("web", NS)  # the emulator's GC deletes its pods
    until(node, lambda: not node.processes() and not node.netns())
    assert not pods_of(emu, "web") and not any(map(alive, pids))
    assert node.service_ips("web") == []


ENV_CHECK = """
import json, os
out = {k: os.environ.get(k) for k in ("PASSWORD", "TOKEN", "MODE", "POD", "POD_IP", "POD_NS",
                                      "SA", "CFG_color", "GREETING", "OPTIONAL")}
out["argv"] = os.environ["ARGV"]
out["file"] = open("/etc/app/settings/color.txt").read()
out["etc_app"] = sorted(os.listdir("/etc/app"))
open("/tmp/mine", "w").write("x")
out["tmp"] = sorted(os.listdir("/tmp"))
out["model"] = open("/models/weights.txt").read()
try:
    open("/models/new", "w")
except OSError as e:
    out["models_write"] = e.errno
print(json.dumps(out))
"""


def test_env_volumes_and_claims(node: LocalNode, emu: KubeEmulator,
                                core: client.CoreV1Api) -> None:
    core.create_namespaced_secret(NS, {"metadata": {"name": "creds"},
                                       "data": {"password": "czNjcjN0"},  # s3cr3t
                                       "stringData": {"token": "tok"}})
    core.create_namespaced_config_map(NS, {"metadata": {"name": "app"}, "data": {
        "mode": "fast", "color": "blue", "ignored": "x"}})
    secret = {"name": "creds", "key": "password"}
    env = [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": secret}},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "app", "key": "mode"}}},
           {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
           {"name": "GREETING", "value": "hi $(POD) $$(POD)"},
           {"name": "OPTIONAL", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k",
                                                                "optional": True}}},
           {"name": "ARGV", "value": "$(MODE)"}]
    volumes = [{"name": "cfg", "configMap": {"name": "app", "items": [
                   {"key": "color", "path": "settings/color.txt"}]}},
               {"name": "tmp", "emptyDir": {}},
               {"name": "models", "persistentVolumeClaim": {"claimName": "models"}}]
    mounts = [{"name": "cfg", "mountPath": "/etc/app"}, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "models", "mountPath": "/models", "readOnly": True}]
    spec = {"volumes": volumes, "container": {
        "env": env, "envFrom": [{"configMapRef": {"name": "app"}, "prefix": "CFG_"}],
        "volumeMounts": mounts}}
    run_pod(core, "envcheck", ENV_CHECK, **spec)
    run_pod(core, "neighbour", "import json, os; print(json.dumps(sorted(os.listdir('/tmp'))))",
            volumes=[{"name": "tmp", "emptyDir": {}}],
            container={"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]})
    out = pod_output(node, emu, "envcheck")
    pod_ip = emu.get("pods", NS, "envcheck")["status"]["podIP"]
    # The image (this checkout, when it lies under /tmp, as CI's may) shows through the
    # pod's /tmp; nothing else of the host's /tmp does.
    image = sorted({Path(p).relative_to("/tmp").parts[0] for p in node.image_paths
                    if Path(p).is_relative_to("/tmp")})
    assert out == {"PASSWORD": "s3cr3t", "TOKEN": "tok", "MODE": "fast", "POD": "envcheck",
                   "POD_IP": pod_ip, "POD_NS": NS, "SA": "default", "CFG_color": "blue",
                   "GREETING": "hi envcheck $(POD)", "OPTIONAL": None, "argv": "fast",
                   "file": "blue", "etc_app": ["settings"], "tmp": sorted(["mine", *image]),
                   "model": "the model\n", "models_write": 30}  # EROFS: a readOnly mount
    assert pod_output(node, emu, "neighbour") == image  # its own emptyDir, not envcheck's
    assert not Path("/tmp/mine").exists()

    # A missing key: the container waits in CreateContainerConfigError until it appears.
    run_pod(core, "late", "import os, json; print(json.dumps(os.environ['LATE']))", container={
        "env": [{"name": "LATE", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}]})
    until(node, lambda: (emu.get("pods", NS, "late") or {}).get("status", {}).get(
        "containerStatuses", [{}])[0].get("state", {}).get("waiting", {}).get("reason")
        == "CreateContainerConfigError")
    core.create_namespaced_secret(NS, {"metadata": {"name": "later"}, "stringData": {"k": "v"}})
    assert pod_output(node, emu, "late") == "v"

    # An unknown claim: the pod stays Pending, unschedulable, with the reason.
    run_pod(core, "noclaim", "print('never')", volumes=[
        {"name": "d", "persistentVolumeClaim": {"claimName": "nowhere"}}])
    cond = until(node, lambda: next((c for c in (emu.get("pods", NS, "noclaim") or {}).get(
        "status", {}).get("conditions", []) if c["type"] == "PodScheduled"
        and c["status"] == "False"), None))
    assert "nowhere" in cond["message"] and cond["reason"] == "Unschedulable"
    assert emu.get("pods", NS, "noclaim")["status"]["phase"] == "Pending"
    for name in ("envcheck", "neighbour", "late", "noclaim"):
        core.delete_namespaced_pod(name, NS)


def test_unschedulable_deployment_keeps_its_replicas(node: LocalNode, emu: KubeEmulator,
                                                     apps: client.AppsV1Api) -> None:
    """Pods no node takes (a GPU node selector on this CPU node) stay Pending, and the
    Deployment controller counts them: exactly ``replicas`` pods, pass after pass (it once
    counted only bound pods and added one every pass)."""
    apps.create_namespaced_deployment(NS, deployment(
        "gpuonly", [container("c", HTTP_SERVER)], replicas=2,
        pod={"nodeSelector": {"nvidia.com/gpu.present": "true"}}))
    until(node, lambda: len(pods_of(emu, "gpuonly")) == 2 and all(
        (p.get("status") or {}).get("phase") == "Pending" for p in pods_of(emu, "gpuonly")))
    time.sleep(10 * node.period)  # ten passes of the node's loop
    pods = pods_of(emu, "gpuonly")
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    assert all(c["reason"] == "Unschedulable" for p in pods for c in p["status"]["conditions"]
               if c["type"] == "PodScheduled")
    apps.delete_namespaced_deployment("gpuonly", NS)
    until(node, lambda: not pods_of(emu, "gpuonly"))


def test_read_only_root_and_user(node: LocalNode, emu: KubeEmulator,
                                 core: client.CoreV1Api) -> None:
    script = """
import getpass, json, os
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
       "user": getpass.getuser()}
for path in ("/var/tmp/escape", "/tmp/inside"):
    try:
        open(path, "w").write("x")
        out[path] = "written"
    except OSError as e:
        out[path] = e.errno
print(json.dumps(out))
"""
    run_pod(core, "readonly", script, securityContext={"runAsUser": 10001, "runAsGroup": 10001,
                                                       "fsGroup": 2000},
            volumes=[{"name": "tmp", "emptyDir": {}}],
            container={"securityContext": {"readOnlyRootFilesystem": True,
                                           "runAsNonRoot": True,
                                           "allowPrivilegeEscalation": False},
                       "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]})
    assert pod_output(node, emu, "readonly") == {
        "uid": 10001, "gid": 10001, "groups": [2000], "user": "app",  # the node's users
        "/var/tmp/escape": 30,  # EROFS
        "/tmp/inside": "written"}
    assert not Path("/var/tmp/escape").exists()
    # runAsNonRoot without a user: the kubelet refuses to create the container.
    run_pod(core, "rootless", "print('never')",
            container={"securityContext": {"runAsNonRoot": True}})
    until(node, lambda: "runAsNonRoot" in str((emu.get("pods", NS, "rootless") or {}).get(
        "status", {}).get("containerStatuses")))
    for name in ("readonly", "rootless"):
        core.delete_namespaced_pod(name, NS)


CRASH = ["python", "-c", "import time; print('start', time.time(), flush=True); exit(3)"]
FLAKY = ["sh", "-c", "touch /tmp/healthy; sleep 1; rm /tmp/healthy; exec sleep 600"]
SLOW_START = ["sh", "-c", "sleep 5; touch /tmp/started; exec sleep 600"]


def test_crash_backoff_and_liveness(node: LocalNode, emu: KubeEmulator,
                                    apps: client.AppsV1Api) -> None:
    apps.create_namespaced_deployment(NS, deployment("crash", [container("c", CRASH)]))
    live = {"exec": {"command": ["test", "-f", "/tmp/healthy"]}, "periodSeconds": 1,
            "failureThreshold": 1}
    apps.create_namespaced_deployment(NS, deployment(
        "flaky", [container("c", FLAKY, livenessProbe=live, volumeMounts=[
            {"name": "tmp", "mountPath": "/tmp"}])],
        pod={"volumes": [{"name": "tmp", "emptyDir": {}}], "terminationGracePeriodSeconds": 1}))
    started = {"exec": {"command": ["test", "-f", "/tmp/started"]}, "periodSeconds": 1,
               "failureThreshold": 30}
    ready = {"exec": {"command": ["true"]}, "periodSeconds": 1}
    apps.create_namespaced_deployment(NS, deployment(
        "slow", [container("c", SLOW_START, startupProbe=started, readinessProbe=ready,
                           volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}])],
        pod={"volumes": [{"name": "tmp", "emptyDir": {}}], "terminationGracePeriodSeconds": 1}))

    def slow_status() -> Obj:
        pods = pods_of(emu, "slow")
        return pods[0]["status"]["containerStatuses"][0] if pods and pods[0].get(
            "status", {}).get("containerStatuses") else {}

    # The startup probe holds readiness back (the readiness probe alone would pass at once).
    running = until(node, lambda: (s := slow_status()).get("state", {}).get("running") and s)
    seen = time.monotonic()
    assert not running["started"] and not running["ready"]
    assert until(node, lambda: (s := slow_status()).get("ready") and s)["started"]
    assert time.monotonic() - seen >= 3.0  # the file appears 5 s after the start (2 s to see it)

    def crash_status() -> Obj:
        pods = pods_of(emu, "crash")
        return pods[0]["status"]["containerStatuses"][0] if pods and pods[0].get(
            "status", {}).get("containerStatuses") else {}

    until(node, lambda: crash_status().get("state", {}).get("waiting", {}).get("reason")
          == "CrashLoopBackOff")
    status = until(node, lambda: (s := crash_status()).get("restartCount", 0) >= 3 and s)
    assert status["lastState"]["terminated"]["exitCode"] == 3
    pod = pods_of(emu, "crash")[0]["metadata"]["name"]

    def starts() -> list[float]:  # the 4th run may be counted before it printed its line
        return [float(line.split()[1]) for line in node.logs(pod).splitlines()
                if line.startswith("start ")]

    gaps = [b - a for a, b in itertools.pairwise(until(node, lambda: len(starts()) >= 4
                                                       and starts()))]
    assert len(gaps) >= 3 and gaps[0] >= 0.4 and gaps[2] > 1.5 * gaps[0], gaps  # 0.5, 1, 2 s

    flaky = until(node, lambda: [p for p in pods_of(emu, "flaky") if p.get("status", {}).get(
        "containerStatuses", [{}])[0].get("restartCount", 0) >= 1])
    assert "liveness probe failed" in node.logs(flaky[0]["metadata"]["name"])
    for name in ("crash", "flaky", "slow"):
        apps.delete_namespaced_deployment(name, NS)
    until(node, lambda: not node.processes())
