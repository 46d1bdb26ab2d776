"""From `kubectl apply` to an answer, as a user runs Cleave on Kubernetes.

The chart's operator Deployment, the managed Redis, the prefill, decode and router pods all run
as real processes on the local node (tests/cluster/README.md), against the API emulator, with
the real helm and kubectl and the real SmolLM2 model; the official `openai` client gets the
answers. The walk-through's commands are docs/operations.md's ("Deploy on a cluster").
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import ROOT, Cluster, doc_commands, until
from kmock_support import KubeEmulator, kube_emulator
from localnode import LocalNode, local_node
from openai import OpenAI

# Not the chart's default: the test shows runtime.image reaches the pods.
RUNTIME_IMAGE = "registry.example.com/ml/cleave-runtime:0.1.0"
USERS = {10001: "cleave", 999: "redis"}  # the images' own users (docker/*.Dockerfile, redis)
SOURCES = ("common", "runtime", "kv_store", "operator", "autoscaling")
STEPS = ["kubectl create namespace cleave-system",
         "helm template cleave charts/cleave --namespace cleave-system --set "
         f"runtime.image={RUNTIME_IMAGE} | kubectl apply -f -",
         "kubectl -n cleave-system rollout status deployment/cleave-operator --timeout=180s",
         "kubectl apply -f examples/cpu-smollm2.yaml",
         "kubectl wait llmservice/smollm2 --for=condition=Ready --timeout=900s",
         "kubectl get llmservice smollm2",
         """kubectl patch llmservice smollm2 --type merge -p '{"spec": {"decode": """
         """{"replicas": 2}}}'""",
         "kubectl wait llmservice/smollm2 --for=condition=Ready --timeout=600s",
         "kubectl rollout status deployment/smollm2-decode --timeout=600s",
         """kubectl patch llmservice smollm2 --type merge -p '{"spec": {"decode": """
         """{"engine": {"maxNumSeqs": 8}}}}'""",
         "kubectl wait llmservice/smollm2 --for=condition=Ready --timeout=600s",
         "kubectl rollout status deployment/smollm2-decode --timeout=600s",
         "kubectl delete -f examples/cpu-smollm2.yaml"]


@pytest.fixture(scope="module")
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPU example's PVC: a tiny Llama where the example expects Llama-3.1-8B."""
    from tiny_model import build_tiny_llama

    root = tmp_path_factory.mktemp("models-pvc")
    build_tiny_llama(root / "Llama-3.1-8B-Instruct")
    for path in (root, *root.rglob("*")):  # a volume the pods' user (10001) can read
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture(scope="module")
def baked() -> Iterator[Path]:
    """The runtime image's baked model (docker/runtime.Dockerfile converts the default model
    into CLEAVE_MODEL_CACHE_PATH at build time): converted once here, read-only to pods. Not
    under /tmp, which pods mount their own emptyDir over, and readable by their user."""
    from cleave.common.settings import DEFAULT_MODEL
    from cleave.runtime.models.loader import resolve_model

    root = Path(tempfile.mkdtemp(prefix="cleave-e2e-image-", dir="/var/tmp"))
    try:
        resolve_model(DEFAULT_MODEL, cache_dir=root)
        for path in (root, *root.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def node(emu: KubeEmulator, models: Path, baked: Path) -> Iterator[LocalNode]:
    # The image is this checkout: its sources first (the venv's own install may be another
    # worktree's), as a runtime image has the code it was built from.
    sources = ":".join(str(ROOT / d) for d in SOURCES)
    with local_node(emu, claims={"models-pvc": models}, users=USERS,
                    image_env={"CLEAVE_MODEL_CACHE_PATH": str(baked),
                               "PYTHONPATH": sources}) as n:
        yield n


@pytest.fixture(scope="module")
def cluster(emu: KubeEmulator, node: LocalNode, tmp_path_factory: pytest.TempPathFactory,
            ) -> Cluster:
    """The operator installed from the chart (the walk-through's first three steps)."""
    c = Cluster(emu.url, tmp_path_factory.mktemp("kube-home"))
    for step in STEPS[:3]:
        c.run(step, timeout=240)
    return c


def test_the_steps_are_the_documented_ones() -> None:
    assert doc_commands() == STEPS


def chat(base_url: str, content: str = "Name a colour.") -> str:
    client = OpenAI(base_url=base_url, api_key="-", timeout=300, max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": content}],
        max_tokens=8, temperature=0)
    text = answer.choices[0].message.content
    assert text and answer.usage and answer.usage.completion_tokens > 0
    return text


def pods(emu: KubeEmulator, instance: str, component: str | None = None) -> list[dict[str, Any]]:
    return [p for p in emu.objects("pods") if (labels := p["metadata"].get("labels") or {})
            .get("app.kubernetes.io/instance") == instance
            and component in (None, labels.get("app.kubernetes.io/component"))]


def generated_tokens(pod: dict[str, Any]) -> float:
    """Tokens a worker pod generated, from its own /metrics (the name the runtime defines)."""
    from prometheus_client.parser import text_string_to_metric_families

    from cleave.runtime.metrics import GENERATION_TOKENS

    url = f"http://{pod['status']['podIP']}:8100/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    [family] = GENERATION_TOKENS.ours.describe()  # the cleave_* twin (labels: role)
    return sum(s.value for f in families if f.name == family.name
               for s in f.samples if s.name.endswith("_total"))


def router_workers(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/internal/workers", timeout=10) as r:
        return dict(json.load(r))


def test_apply_to_answer_scale_roll_and_delete(emu: KubeEmulator, node: LocalNode,
                                               cluster: Cluster) -> None:
    operator = pods(emu, "cleave")
    assert len(operator) == 1 and operator[0]["status"]["phase"] == "Running"
    values = yaml.safe_load((ROOT / "charts" / "cleave" / "values.yaml").read_text())
    [container] = operator[0]["spec"]["containers"]
    assert container["resources"] == values["operator"]["resources"]  # the chart's values
    assert operator[0]["spec"]["serviceAccountName"] == "cleave"  # its RBAC, enforced here
    operator_pids = set(node.processes())
    start = time.monotonic()
    cluster.run(STEPS[3])
    cluster.run(STEPS[4], timeout=960)
    ready_at = time.monotonic()
    router = node.service_url("smollm2-router", "default", 8000)
    first = chat(router + "/v1")
    answered_at = time.monotonic()
    print(f"\ncluster apply_to_ready_s={ready_at - start:.1f} "
          f"apply_to_first_answer_s={answered_at - start:.1f} answer={first!r}")
    service = cluster.get("llmservice", "smollm2")
    conditions = {c["type"]: c["status"] for c in service["status"]["conditions"]}
    assert conditions["Ready"] == "True", service["status"]
    assert service["status"]["endpoint"] == "http://smollm2-router.default.svc:8000/v1"
    assert "smollm2" in cluster.run(STEPS[5])
    # The chart's runtime.image reached every data-plane pod (the service sets no image), and
    # each loaded the image's baked model instead of converting it into its empty /cache.
    for pod in pods(emu, "smollm2"):
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
            assert pod["spec"]["containers"][0]["image"] == RUNTIME_IMAGE
            assert "converting" not in node.logs(pod["metadata"]["name"])

    cluster.run(STEPS[6])
    cluster.run(STEPS[7], timeout=660)
    # `kubectl wait` returned only once the operator had acted on the patched generation.
    decode = emu.get("deployments", "default", "smollm2-decode")
    assert decode is not None and decode["spec"]["replicas"] == 2
    cluster.run(STEPS[8], timeout=660)
    decode_ips = {p["status"]["podIP"] for p in pods(emu, "smollm2", "decode")}
    assert len(decode_ips) == 2
    until(lambda: {w["url"] for w in router_workers(router)["decode"] if w["healthy"]}
          == {f"http://{ip}:8100" for ip in decode_ips}, 120, node.dump)
    # The second pod serves: the router sends a request to the least loaded decode worker,
    # so requests in parallel reach both (one at a time, the tie always goes to one).
    decode_pods = pods(emu, "smollm2", "decode")

    def both_serve() -> bool:
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(lambda i: chat(router + "/v1", f"Colour number {i}?"),
                                range(4)))
        return all(generated_tokens(p) > 0 for p in decode_pods)

    until(both_serve, 180, node.dump)

    before = {p["metadata"]["name"] for p in pods(emu, "smollm2", "decode")}
    cluster.run(STEPS[9])
    cluster.run(STEPS[10], timeout=660)
    cluster.run(STEPS[11], timeout=660)
    rolled = pods(emu, "smollm2", "decode")
    assert len(rolled) == 2 and not before & {p["metadata"]["name"] for p in rolled}
    for pod in rolled:
        assert "--max-num-seqs=8" in pod["spec"]["containers"][0]["args"]
    until(lambda: len([w for w in router_workers(router)["decode"] if w["healthy"]]) == 2,
          180, node.dump)
    chat(router + "/v1")

    cluster.run(STEPS[12])
    until(lambda: not pods(emu, "smollm2") and set(node.processes()) == operator_pids, 120,
          node.dump)
    assert not [o for kind in ("deployments", "statefulsets", "services", "secrets")
                for o in emu.objects(kind, "default")
                if o["metadata"]["name"].startswith("smollm2-")]


# The Redis the external-redis example expects at redis.infra.svc:6379 (a user's own).
INFRA_REDIS = """
apiVersion: v1
kind: Namespace
metadata: {name: infra}
---
apiVersion: v1
kind: Service
metadata: {name: redis, namespace: infra}
spec:
  clusterIP: None
  selector: {app: redis}
  ports: [{name: redis, port: 6379}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: redis, namespace: infra}
spec:
  serviceName: redis
  selector: {matchLabels: {app: redis}}
  template:
    metadata: {labels: {app: redis}}
    spec:
      containers:
        - name: redis
          image: redis:7.2
          command: [redis-server, --requirepass, change-me, --save, "", --appendonly, "no"]
          ports: [{containerPort: 6379}]
          readinessProbe: {tcpSocket: {port: 6379}, periodSeconds: 2}
"""


def test_external_redis_example_serves_through_the_users_redis(
        emu: KubeEmulator, node: LocalNode, cluster: Cluster) -> None:
    import redis

    cluster.kubectl_apply(INFRA_REDIS)
    node.wait_ready("statefulset", "redis", "infra", timeout=60)
    cluster.run("kubectl apply -f examples/external-redis.yaml")
    cluster.run("kubectl wait llmservice/chat --for=condition=Ready --timeout=900s", timeout=960)
    assert len([p for p in pods(emu, "chat", "decode")
                if p["status"].get("phase") == "Running"]) == 2  # the example's two
    router = node.service_url("chat-router", "default", 8000)
    long_prompt = "Tell me about the sea. " * 20  # past disaggregateMinTokens: prefilled
    chat(router + "/v1", long_prompt)
    [ip] = node.service_ips("redis", "infra")
    store = redis.Redis(host=ip, port=6379, password="change-me", socket_timeout=5)
    assert list(store.scan_iter("cleave:*", count=1000)), "no KV block reached the user's Redis"
    cluster.run("kubectl delete -f examples/external-redis.yaml")
    until(lambda: not pods(emu, "chat"), 120, node.dump)


def test_gpu_example_waits_for_gpus_and_its_commands_check(
        emu: KubeEmulator, node: LocalNode, cluster: Cluster) -> None:
    """No GPU here: the GPU workers stay Pending as on a CPU-only cluster, and each container's
    command, run with --check (the example's PVC holds a small Llama where the 8B one would be),
    parses every flag, resolves the model and the engine configuration, and exits 0."""
    cluster.run("kubectl apply -f examples/gpu-service.yaml")
    def unschedulable() -> list[dict[str, Any]]:
        workers = pods(emu, "llama-8b", "prefill") + pods(emu, "llama-8b", "decode")
        return [c for p in workers for c in (p.get("status") or {}).get("conditions") or []
                if c["type"] == "PodScheduled" and c["status"] == "False"
                and c["reason"] == "Unschedulable"]

    for condition in until(lambda: len(unschedulable()) == 2 and unschedulable(), 120,
                           node.dump):
        assert "node affinity/selector" in condition["message"]  # no GPU node pool here
    checked = []
    for deployment in emu.objects("deployments", "default"):
        if not deployment["metadata"]["name"].startswith("llama-8b-"):
            continue
        template = deployment["spec"]["template"]
        spec = {**template["spec"], "restartPolicy": "Never"}
        spec.pop("nodeSelector", None)  # the check runs on this CPU node
        [container] = spec["containers"]
        spec["containers"] = [{**container, "args": [*container["args"], "--check"],
                               "resources": {}}]
        name = f"check-{deployment['metadata']['name']}"
        cluster.kubectl_apply(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": "default"}, "spec": spec}))
        until(lambda name=name: (emu.get("pods", "default", name) or {}).get(
            "status", {}).get("phase") in ("Succeeded", "Failed"), 180, node.dump)
        phase = emu.get("pods", "default", name)["status"]["phase"]
        assert phase == "Succeeded", node.logs(name)
        assert "configuration OK" in node.logs(name)
        checked.append(container["args"][0])
    assert sorted(checked) == ["router", "worker", "worker"]
    cluster.run("kubectl delete -f examples/gpu-service.yaml")
