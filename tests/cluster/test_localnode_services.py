"""The local node runs stateful and API-using workloads: a password-protected Redis
StatefulSet, in-cluster clients through the TLS API proxy under RBAC, termination grace and
rollouts. Real processes throughout (see test_localnode.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import redis
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


def test_redis_statefulset_with_password(node: LocalNode, emu: KubeEmulator,
                                         core: client.CoreV1Api,
                                         apps: client.AppsV1Api) -> None:
    core.create_namespaced_secret(NS, {"metadata": {"name": "redis-auth"},
                                       "stringData": {"password": "pw-123"}})
    redis_c = container(
        "redis", ["sh", "-c", 'exec redis-server --requirepass "$REDIS_PASSWORD" --save "" '
                  '--appendonly no --port 6379'],
        env=[{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": "redis-auth", "key": "password"}}}],
        ports=[{"name": "redis", "containerPort": 6379}],
        readinessProbe={"tcpSocket": {"port": "redis"}, "periodSeconds": 1},
        securityContext={"runAsUser": 999, "runAsNonRoot": True, "readOnlyRootFilesystem": True},
        volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}, {"name": "data", "mountPath": "/data"}])
    sts = deployment("redis", [redis_c], pod={"volumes": [{"name": "tmp", "emptyDir": {}},
                                                          {"name": "data", "emptyDir": {}}]})
    sts.update(kind="StatefulSet")
    sts["spec"]["serviceName"] = "redis"
    apps.create_namespaced_stateful_set(NS, sts)
    core.create_namespaced_service(NS, {"metadata": {"name": "redis"}, "spec": {
        "selector": {"app": "redis"}, "ports": [{"port": 6379}]}})
    status = node.wait_ready("statefulset", "redis")["status"]
    assert (status["readyReplicas"], status["replicas"]) == (1, 1)
    pod = emu.get("pods", NS, "redis-0")
    assert pod and pod["spec"]["hostname"] == "redis-0"
    [pid] = node.processes()
    assert "\t999\t" in Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split("\n")[0]
    url = node.service_url("redis")
    assert url == f"http://{pod['status']['podIP']}:6379"
    assert redis.Redis(host=pod["status"]["podIP"], password="pw-123").ping()
    with socket.create_connection((pod["status"]["podIP"], 6379), timeout=5) as raw:
        raw.sendall(b"PING\r\n")  # no password: refused (redis-py would retry for seconds)
        assert raw.recv(100).startswith(b"-NOAUTH")
    # From a non-root pod (the venv's Python made reachable) by Service and per-pod names.
    script = """
import json, os, redis
print(json.dumps([redis.Redis(host=h, password=os.environ["PW"]).ping()
                  for h in ("redis", "redis.default.svc", "redis-0.redis")]))
"""
    run_pod(core, "redis-client", script, securityContext={"runAsUser": 10001},
            container={"env": [{"name": "PW", "valueFrom": {"secretKeyRef": {
                "name": "redis-auth", "key": "password"}}}]})
    assert pod_output(node, emu, "redis-client") == [True, True, True]
    core.delete_namespaced_pod("redis-client", NS)
    apps.delete_namespaced_stateful_set("redis", NS)
    until(node, lambda: not node.processes())


IN_CLUSTER = """
import json, kubernetes
from kubernetes import client, config, watch
config.load_incluster_config()
v1 = client.CoreV1Api()
events = watch.Watch().stream(v1.list_namespaced_config_map, "default", timeout_seconds=2)
print(json.dumps({
    "namespaces": [n.metadata.name for n in v1.list_namespace().items],
    "color": v1.read_namespaced_config_map("incluster", "default").data["color"],
    "watched": next(e["object"].metadata.name for e in events
                    if e["object"].metadata.name == "incluster"),
    "ns_file": open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()}))
"""


@pytest.fixture(scope="module")
def rbac(emu: KubeEmulator) -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(emu.api_client())


def grant(rbac: client.RbacAuthorizationV1Api, name: str, sa: str, rules: list[Obj],
          namespace: str | None = NS) -> None:
    """A Role and RoleBinding in ``namespace`` (None: ClusterRole, ClusterRoleBinding) for
    the ServiceAccount ``sa`` of NS."""
    kind = "Role" if namespace else "ClusterRole"
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}
    binding = {"metadata": {"name": name}, "roleRef": ref,
               "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]}
    if namespace:
        rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
        rbac.create_namespaced_role_binding(namespace, binding)
    else:
        rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules})
        rbac.create_cluster_role_binding(binding)


def test_service_account_in_cluster_client(node: LocalNode, emu: KubeEmulator,
                                           core: client.CoreV1Api,
                                           rbac: client.RbacAuthorizationV1Api) -> None:
    core.create_namespaced_config_map(NS, {"metadata": {"name": "incluster"},
                                           "data": {"color": "green"}})
    # What the script does, as the proxy's RBAC requires: list namespaces (cluster-scoped),
    # read and watch ConfigMaps in its namespace.
    grant(rbac, "incluster-namespaces", "default",
          [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list"]}], None)
    grant(rbac, "incluster-configmaps", "default",
          [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}])
    run_pod(core, "incluster", IN_CLUSTER, automountServiceAccountToken=True,
            securityContext={"runAsUser": 65532, "runAsNonRoot": True},
            volumes=[{"name": "tmp", "emptyDir": {}}],
            container={"securityContext": {"readOnlyRootFilesystem": True},
                       "env": [{"name": "HOME", "value": "/tmp"}],
                       "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]})
    assert pod_output(node, emu, "incluster") == {
        "namespaces": ["default"], "color": "green", "watched": "incluster", "ns_file": NS}
    # automountServiceAccountToken: false: no token in the pod.
    run_pod(core, "notoken", "import json, os; print(json.dumps(os.path.exists("
            "'/var/run/secrets/kubernetes.io/serviceaccount/token')))",
            automountServiceAccountToken=False)
    assert pod_output(node, emu, "notoken") is False
    for name in ("incluster", "notoken"):
        core.delete_namespaced_pod(name, NS)
    rbac.delete_cluster_role_binding("incluster-namespaces")
    rbac.delete_namespaced_role_binding("incluster-configmaps", NS)


RBAC_CHECK = """
import json
from kubernetes import client, config
config.load_incluster_config()
v1 = client.CoreV1Api()

def attempt(call, *args):
    try:
        call(*args)
        return "ok"
    except client.ApiException as e:
        body = json.loads(e.body)
        return [e.status, body["reason"], body["message"]]

print(json.dumps({
    "list": sorted(c.metadata.name for c in v1.list_namespaced_config_map("default").items),
    "get": v1.read_namespaced_config_map("shared", "default").data,
    "create": attempt(v1.create_namespaced_config_map, "default", {"metadata": {"name": "x"}}),
    "other": attempt(v1.list_namespaced_config_map, "other"),
    "all": attempt(v1.list_config_map_for_all_namespaces)}))
"""


def test_rbac_denies_what_the_service_account_is_not_granted(
        node: LocalNode, emu: KubeEmulator, core: client.CoreV1Api,
        rbac: client.RbacAuthorizationV1Api) -> None:
    core.create_namespace({"metadata": {"name": "other"}})
    core.create_namespaced_config_map("other", {"metadata": {"name": "theirs"}})
    core.create_namespaced_config_map(NS, {"metadata": {"name": "shared"}, "data": {"k": "v"}})
    core.create_namespaced_service_account(NS, {"metadata": {"name": "reader"}})
    grant(rbac, "configmap-reader", "reader",
          [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}])
    run_pod(core, "rbac-reader", RBAC_CHECK, serviceAccountName="reader")
    out = pod_output(node, emu, "rbac-reader")
    user = 'User "system:serviceaccount:default:reader"'
    assert "shared" in out["list"] and out["get"] == {"k": "v"}
    assert out["create"] == [403, "Forbidden", f"configmaps is forbidden: {user} cannot create "
                             'resource "configmaps" in API group "" in the namespace "default"']
    assert out["other"] == [403, "Forbidden", f"configmaps is forbidden: {user} cannot list "
                            'resource "configmaps" in API group "" in the namespace "other"']
    assert out["all"] == [403, "Forbidden", f"configmaps is forbidden: {user} cannot list "
                          'resource "configmaps" in API group "" at the cluster scope']
    assert not emu.get("configmaps", NS, "x")  # the denied create never reached the API
    core.delete_namespaced_pod("rbac-reader", NS)
    rbac.delete_namespaced_role_binding("configmap-reader", NS)


STUBBORN = ["python", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            " print('up', flush=True); time.sleep(600)"]


def test_sigterm_grace_then_sigkill_and_replacement(node: LocalNode, emu: KubeEmulator,
                                                    core: client.CoreV1Api,
                                                    apps: client.AppsV1Api) -> None:
    apps.create_namespaced_deployment(NS, deployment(
        "stubborn", [container("c", STUBBORN)], pod={"terminationGracePeriodSeconds": 2}))
    node.wait_ready("deployment", "stubborn")
    [first] = pods_of(emu, "stubborn")
    until(node, lambda: "up" in node.logs(first["metadata"]["name"]))
    [pid] = node.processes()
    deleted = time.monotonic()
    core.delete_namespaced_pod(first["metadata"]["name"], NS)  # kubectl delete pod
    time.sleep(1.0)
    assert alive(pid)  # SIGTERM is ignored: it lives through the grace period
    until(node, lambda: not alive(pid), timeout=40)
    # Killed after the 2 s grace (it would sleep 600 s otherwise); the slack is a loaded box's.
    assert 1.8 <= time.monotonic() - deleted <= 30.0
    node.wait_ready("deployment", "stubborn")  # replaced by a new pod
    [second] = pods_of(emu, "stubborn")
    assert second["metadata"]["name"] != first["metadata"]["name"]
    apps.delete_namespaced_deployment("stubborn", NS)
    until(node, lambda: not node.processes(), timeout=40)


def test_rollouts_recreate_and_rolling(node: LocalNode, emu: KubeEmulator,
                                       apps: client.AppsV1Api) -> None:
    web = container("web", HTTP_SERVER, ports=[{"name": "http", "containerPort": 8100}],
                    readinessProbe=READY_HTTP)
    apps.create_namespaced_deployment(NS, deployment("recreate", [web],
                                                     strategy={"type": "Recreate"}))
    apps.create_namespaced_deployment(NS, deployment("rolling", [web], replicas=2))
    for name in ("recreate", "rolling"):
        node.wait_ready("deployment", name)
    before = {name: {p["metadata"]["name"] for p in pods_of(emu, name)}
              for name in ("recreate", "rolling")}
    patch = {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}
    for name in ("recreate", "rolling"):
        apps.patch_namespaced_deployment(name, NS, patch)
    # RollingUpdate: never fewer ready pods than wanted while it rolls.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        dep = emu.get("deployments", NS, "rolling")
        assert dep and dep["status"].get("readyReplicas", 0) >= 2, node.dump()
        if not before["rolling"] & {p["metadata"]["name"] for p in pods_of(emu, "rolling")}:
            break
        time.sleep(0.05)
    for name in ("recreate", "rolling"):
        dep = node.wait_ready("deployment", name)
        assert dep["status"]["observedGeneration"] == 2
        after = {p["metadata"]["name"] for p in pods_of(emu, name)}
        assert after and not after & before[name]
        assert all(p["metadata"]["annotations"] == {"rev": "2"} for p in pods_of(emu, name))
    for name in ("recreate", "rolling"):
        apps.delete_namespaced_deployment(name, NS)
    until(node, lambda: not node.processes())
