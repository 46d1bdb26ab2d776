"""Desired state: an LLMService spec -> its children, as pure functions."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from cleave.common.settings import RouterSettings, WorkerSettings
from cleave.operator.builders import (
    desired_children,
    endpoint,
    owner_reference,
    worker_deployment,
)
from cleave.operator.kube import without_nulls
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.spec import SpecError, parse_spec

BASE: dict[str, Any] = {
    "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
    "spec": {
        "model": {"name": "smol", "source": "smollm2-135m-instruct"},
        "prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "nodeSelector": {"gpu": "h200"}},
        "decode": {"replicas": 3, "engine": {"kvCacheMemory": "4Gi"}},
        "kvStore": {"managed": {"memory": "1Gi"}},
    },
}

PASSWORDS = RedisPasswords("adm", "wpw", "rpw")


def build(obj: dict[str, Any], replicas: dict[str, int | None] | None = None
          ) -> dict[str, dict[str, Any]]:
    spec = parse_spec(obj)
    children = desired_children(spec, owner_reference(obj), PASSWORDS,
                                replicas or {"prefill": 2, "decode": 3, "router": 1}, "salt",
                                internal_token="tok")
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def container_of(child: dict[str, Any]) -> dict[str, Any]:
    [container] = child["spec"]["template"]["spec"]["containers"]
    return dict(container)


def parsed(child: dict[str, Any]) -> Any:
    """A built container's command line as the real `cleave` CLI parses it: a flag the CLI
    does not know, or a value it refuses, fails here as it would crash-loop the pod."""
    from cleave.common.cli import build_parser

    container = container_of(child)
    assert container["command"] == ["cleave"]
    args = build_parser().parse_args(container["args"])
    assert not args.check
    settings_class = {"worker": WorkerSettings, "router": RouterSettings}[args.command]
    return settings_class.from_args(args)


def test_every_child_is_owned_labelled_and_named_after_the_service() -> None:
    children = build(BASE)
    assert set(children) == {
        "ConfigMap/chat-config", "Secret/chat-redis-users", "Service/chat-redis",
        "Secret/chat-kv-salt", "PodDisruptionBudget/chat-prefill",
        "PodDisruptionBudget/chat-decode", "PodDisruptionBudget/chat-router",
        "StatefulSet/chat-redis", "Deployment/chat-prefill", "Service/chat-prefill",
        "Deployment/chat-decode", "Service/chat-decode", "Deployment/chat-router",
        "Service/chat-router", "Secret/chat-internal-token", "NetworkPolicy/chat-workers",
        "NetworkPolicy/chat-redis"}
    for child in children.values():
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        [owner] = meta["ownerReferences"]
        assert owner == {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
                         "name": "chat", "uid": "u-1", "controller": True,
                         "blockOwnerDeletion": True}
        assert meta["labels"]["app.kubernetes.io/instance"] == "chat"


def test_roles_get_their_gpus_tolerations_and_replicas() -> None:
    children = build(BASE)
    prefill = children["Deployment/chat-prefill"]
    pod = prefill["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert prefill["spec"]["replicas"] == 2
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    ints = copy.deepcopy(BASE)
    ints["spec"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 1, "cpu": 2}}
    quantities = build(ints)["Deployment/chat-prefill"]["spec"]["template"]["spec"][
        "containers"][0]["resources"]
    assert quantities == {"limits": {"nvidia.com/gpu": "1", "cpu": "2"}}  # ints from YAML
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert parsed(prefill).engine.device == "cuda"
    decode = parsed(children["Deployment/chat-decode"])
    assert decode.engine.kv_cache_memory == 4 << 30  # the CRD's quantity, read as Kubernetes does
    assert decode.role == "decode"
    assert decode.engine.device == "auto"  # no GPU asked for: the runtime picks the CPU


@pytest.mark.parametrize(("quantity", "expected"), [
    ("256Mi", 256 << 20), ("1G", 10**9), ("1500M", 1_500_000_000), (1048576, 1 << 20)])
def test_kv_cache_memory_is_a_kubernetes_quantity(quantity: Any, expected: int) -> None:
    """examples/ once set 256Mi, which the worker refused: every worker pod crash-looped."""
    obj = copy.deepcopy(BASE)
    obj["spec"]["decode"]["engine"]["kvCacheMemory"] = quantity
    assert parsed(build(obj)["Deployment/chat-decode"]).engine.kv_cache_memory == expected


def test_pods_take_the_placement_users_set_per_role() -> None:
    obj = copy.deepcopy(BASE)
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
               "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
    obj["spec"]["decode"].update(topologySpreadConstraints=spread, affinity=affinity,
                                 priorityClassName="inference", runtimeClassName="nvidia",
                                 startupTimeoutSeconds=1800,
                                 podDisruptionBudget={"maxUnavailable": "25%"})
    obj["spec"]["router"] = {"priorityClassName": "edge", "nodeSelector": {"pool": "cpu"}}
    obj["spec"]["imagePullSecrets"] = [{"name": "regcred"}]
    children = build(obj)
    decode = children["Deployment/chat-decode"]["spec"]["template"]["spec"]
    assert decode["topologySpreadConstraints"] == spread and decode["affinity"] == affinity
    assert (decode["priorityClassName"], decode["runtimeClassName"]) == ("inference", "nvidia")
    startup = decode["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    assert children["PodDisruptionBudget/chat-decode"]["spec"] == {
        "maxUnavailable": "25%", "selector": {"matchLabels": children[
            "Deployment/chat-decode"]["spec"]["selector"]["matchLabels"]}}
    assert children["PodDisruptionBudget/chat-prefill"]["spec"]["maxUnavailable"] == 1
    router = children["Deployment/chat-router"]["spec"]["template"]["spec"]
    assert (router["priorityClassName"], router["nodeSelector"]) == ("edge", {"pool": "cpu"})
    assert router["affinity"] is None and children[  # null: a patch removes an old one
        "Deployment/chat-prefill"]["spec"]["template"]["spec"]["priorityClassName"] is None
    for name in ("Deployment/chat-decode", "Deployment/chat-router", "StatefulSet/chat-redis"):
        pod = children[name]["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    valid_for_the_apiserver(children)


def valid_for_the_apiserver(children: dict[str, dict[str, Any]]) -> None:
    """Every child against its core/v1, apps/v1, policy/v1 schema (kubernetes-validate, strict
    as the apiserver): the pass-through pod fields included."""
    import kubernetes_validate

    for child in children.values():  # as created: without the nulls that only patches need
        kubernetes_validate.validate(without_nulls(child), "1.35.0", strict=True)



def test_only_gpu_pods_get_a_memory_backed_dev_shm() -> None:
    children = build(BASE)
    for role, gpu in (("prefill", True), ("decode", False)):
        pod = children[f"Deployment/chat-{role}"]["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert ("/dev/shm" in mounts) == gpu
        if gpu:
            assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}


def test_pods_are_locked_down() -> None:
    for name in ("Deployment/chat-prefill", "Deployment/chat-decode", "Deployment/chat-router"):
        pod = build(BASE)[name]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        sc = pod["containers"][0]["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and not sc["allowPrivilegeEscalation"]
        probes = pod["containers"][0]
        assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
        # The pod outlives the worker's drain period.
        assert pod["terminationGracePeriodSeconds"] > 30


def test_router_finds_workers_through_headless_services() -> None:
    children = build(BASE)
    for role in ("prefill", "decode"):
        assert children[f"Service/chat-{role}"]["spec"]["clusterIP"] == "None"
    router = parsed(children["Deployment/chat-router"])
    assert router.prefill == ("dns+http://chat-prefill.ml.svc:8100",)
    assert router.decode == ("dns+http://chat-decode.ml.svc:8100",)
    assert endpoint(parse_spec(BASE)) == "http://chat-router.ml.svc:8000/v1"


def test_the_router_serves_the_name_then_its_aliases_and_workers_label_with_the_name() -> None:
    """vLLM's --served-model-name NAME [NAME ...]: responses and the vllm:* metrics carry the
    first. Workers get the name alone, so that a changed alias rolls only the router."""
    obj = copy.deepcopy(BASE)
    children = build(obj)
    assert parsed(children["Deployment/chat-router"]).served.served_model_name == ("smol",)
    obj["spec"]["model"]["aliases"] = ["smol-latest", "chat"]
    children = build(obj)
    router = parsed(children["Deployment/chat-router"])
    assert router.served.names(router.model) == ("smol", "smol-latest", "chat")
    for role in ("prefill", "decode"):
        assert parsed(children[f"Deployment/chat-{role}"]).served.served_model_name == ("smol",)
    assert build(BASE)["Deployment/chat-decode"] == children["Deployment/chat-decode"]


@pytest.mark.parametrize("spec", [
    {"model": {"name": "m", "source": "s"}, "decode": {}, "kvStore": "x"},
    {"model": {"name": "m", "source": "s"}, "decode": "two"},
    {"model": {"name": "m", "source": "s"}, "decode": {"autoscaling": []}},
    {"model": ["m"], "decode": {}},
    {"model": {"name": "m", "source": "s", "aliases": "m2"}, "decode": {}},
    {"model": {"name": "m", "source": "s", "aliases": [""]}, "decode": {}},
])
def test_wrongly_shaped_specs_are_spec_errors_not_crashes(spec: dict[str, Any]) -> None:
    with pytest.raises(SpecError):
        parse_spec({"metadata": {"name": "a", "namespace": "d"}, "spec": spec})


def test_router_holds_requests_only_when_roles_can_scale_to_zero() -> None:
    def hold(obj: dict[str, Any]) -> float | None:
        return parsed(build(obj)["Deployment/chat-router"]).routing.hold_timeout  # type: ignore[no-any-return]

    assert hold(BASE) is None  # no hold: a fast 503 when workers are gone
    to_zero = copy.deepcopy(BASE)
    to_zero["spec"]["autoscaling"] = {"scaleToZero": True}
    assert (hold(to_zero) or 0) >= 60
    to_zero["spec"]["autoscaling"]["mode"] = "External"  # nobody here wakes the roles
    assert hold(to_zero) is None


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_a_quoted_or_numeric_boolean_is_refused_not_read_as_true(value: Any) -> None:
    """bool("false") is True: scaleToZero "false" once turned scale to zero on."""
    obj = copy.deepcopy(BASE)
    obj["spec"]["autoscaling"] = {"scaleToZero": value}
    with pytest.raises(SpecError, match="scaleToZero must be true or false"):
        parse_spec(obj)


@pytest.mark.parametrize("name", ["Chat", "1chat", "chat-", "chat_bot", "a" * 41, ""])
def test_a_name_that_cannot_name_a_service_is_refused(name: str) -> None:
    obj = copy.deepcopy(BASE)
    obj["metadata"]["name"] = name
    with pytest.raises(SpecError, match=r"metadata\.name"):
        parse_spec(obj)


def test_each_component_takes_only_its_own_redis_users_password() -> None:
    children = build(BASE)
    assert children["Secret/chat-redis-users"]["stringData"] == {
        "admin": "adm", "worker": "wpw", "router": "rpw"}
    for role, user, key in (("prefill", "cleave-worker", "worker"),
                            ("decode", "cleave-worker", "worker"),
                            ("router", "cleave-router", "router")):
        deployment = children[f"Deployment/chat-{role}"]
        env = container_of(deployment)["env"]
        refs = [e["valueFrom"]["secretKeyRef"] for e in env
                if "chat-redis-users" in json.dumps(e)]
        assert refs == [{"name": "chat-redis-users", "key": key}]
        assert next(e for e in env if e["name"] == "CLEAVE_REDIS_PASSWORD")["valueFrom"] == {
            "secretKeyRef": {"name": "chat-redis-users", "key": key}}
        settings = parsed(deployment)
        url = (settings.redis if role == "router" else settings.store.redis).redis_url
        assert url == f"redis://{user}@chat-redis.ml.svc:6379/0"
    redis = children["StatefulSet/chat-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in redis["env"]} == {
        "admin", "worker", "router"}
    assert "--aclfile" in redis["command"][-1] and "--requirepass" not in redis["command"][-1]
    assert not {"adm", "wpw", "rpw"} & set(json.dumps(redis).replace('"', " ").split())
    assert "--maxmemory 858993459" in redis["command"][-1]  # 80 % of 1Gi


def test_external_redis_uses_the_users_secret_and_no_managed_children() -> None:
    obj = copy.deepcopy(BASE)
    obj["spec"]["kvStore"] = {"external": {"url": "rediss://cache.infra:6380/0",
                                           "passwordSecret": {"name": "rs", "key": "pass"}}}
    children = build(obj)
    assert not any("redis" in k for k in children)
    container = container_of(children["Deployment/chat-prefill"])
    assert parsed(children["Deployment/chat-prefill"]).store.redis.redis_url.startswith("rediss://")
    ref = next(e for e in container["env"] if e["name"] == "CLEAVE_REDIS_PASSWORD")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "rs", "key": "pass"}


def test_replicas_left_out_when_someone_else_owns_them() -> None:
    children = build(BASE, {"prefill": None, "decode": 5, "router": None})
    assert "replicas" not in children["Deployment/chat-prefill"]["spec"]
    assert "replicas" not in children["Deployment/chat-router"]["spec"]
    assert children["Deployment/chat-decode"]["spec"]["replicas"] == 5


def test_decode_only_service_has_no_prefill_children() -> None:
    obj = copy.deepcopy(BASE)
    del obj["spec"]["prefill"]
    children = build(obj)
    assert "Deployment/chat-prefill" not in children
    assert parsed(children["Deployment/chat-router"]).prefill == ()


def test_building_is_deterministic() -> None:
    assert build(BASE) == build(copy.deepcopy(BASE))


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("model"), "model"),
    (lambda s: s["model"].update(source=""), "source"),
    (lambda s: s.pop("decode"), "decode"),
    (lambda s: s.update(kvStore={}), "exactly one"),
    (lambda s: s["kvStore"].update(external={"url": "redis://x"}), "exactly one"),
    (lambda s: s["decode"].update(autoscaling={"minReplicas": 4, "maxReplicas": 2}),
     "minReplicas 4 > maxReplicas 2"),
    (lambda s: s["decode"].update(replicas=-1), "replicas"),
    (lambda s: s["model"].update(dtype="int4"), "dtype"),
    (lambda s: s.update(autoscaling={"mode": "Sometimes"}), "mode"),
    (lambda s: s.update(kvStore={"external": {"url": "redis://:hunter2@r.infra:6379/0"}}),
     "passwordSecret"),
    (lambda s: s.update(kvStore={"external": {"url": "redis://r.infra:6379/0?password=x"}}),
     "passwordSecret"),
])
def test_specs_the_operator_cannot_honour_are_refused_clearly(mutate: Any,
                                                              message: str) -> None:
    obj = copy.deepcopy(BASE)
    mutate(obj["spec"])
    with pytest.raises(SpecError, match=message):
        parse_spec(obj)


def test_worker_args_carry_the_service_namespace_for_kv_isolation() -> None:
    spec = parse_spec(BASE)
    dep = worker_deployment(spec, "decode", spec.decode, owner_reference(BASE), 1)
    settings = parsed(dep)
    assert settings.store.namespace == "ml.chat"  # the Kubernetes namespace, then the name
    assert settings.store.kv_ttl_seconds == 3600  # kvStore.ttlSeconds reaches the store
    ttl = copy.deepcopy(BASE)
    ttl["spec"]["kvStore"]["ttlSeconds"] = 120
    assert parsed(build(ttl)["Deployment/chat-decode"]).store.kv_ttl_seconds == 120


def test_each_service_gets_its_own_salt_unless_it_names_one() -> None:
    env = {e["name"]: e for e in container_of(build(BASE)["Deployment/chat-decode"])["env"]}
    assert env["CLEAVE_KV_SALT"]["valueFrom"]["secretKeyRef"] == {"name": "chat-kv-salt",
                                                                   "key": "salt"}
    assert build(BASE)["Secret/chat-kv-salt"]["stringData"] == {"salt": "salt"}
    shared = copy.deepcopy(BASE)
    shared["spec"]["kvStore"]["saltSecret"] = {"name": "team-salt", "key": "s"}
    children = build(shared)
    assert "Secret/chat-kv-salt" not in children
    env = {e["name"]: e for e in container_of(children["Deployment/chat-prefill"])["env"]}
    assert env["CLEAVE_KV_SALT"]["valueFrom"]["secretKeyRef"] == {"name": "team-salt",
                                                                   "key": "s"}


@pytest.mark.parametrize("example", ["cpu-smollm2.yaml", "gpu-service.yaml",
                                     "external-redis.yaml"])
def test_every_example_the_crd_accepts_the_operator_can_build(example: str) -> None:
    """The CRD schema (with its defaults) and the operator's spec model agree."""
    from pathlib import Path

    import yaml
    from crd_validation import apply_defaults, validate

    root = Path(__file__).parents[2]
    docs = list(yaml.safe_load_all((root / "examples" / example).read_text()))
    service = next(d for d in docs if d["kind"] == "LLMService")
    assert validate(service) == []
    obj = apply_defaults(copy.deepcopy(service))
    obj["metadata"].setdefault("namespace", "default")
    obj["metadata"]["uid"] = "u-2"
    children = build(obj)
    assert f"Deployment/{obj['metadata']['name']}-decode" in children
    valid_for_the_apiserver(children)


def test_gpu_workers_run_the_charts_cuda_image_unless_the_service_names_one() -> None:
    spec = parse_spec(BASE, "cpu-image", "cuda-image")  # prefill has a GPU, decode none
    children = desired_children(spec, owner_reference(BASE), PASSWORDS,
                                {"prefill": 1, "decode": 1, "router": 1}, "salt",
                                internal_token="tok")
    images = {c["metadata"]["name"]: container_of(c)["image"] for c in children
              if c["kind"] == "Deployment"}
    assert images == {"chat-prefill": "cuda-image", "chat-decode": "cpu-image",
                      "chat-router": "cpu-image"}
    assert parse_spec(BASE, "cpu-image").gpu_image == "cpu-image"  # no CUDA image: the one
    own = copy.deepcopy(BASE)
    own["spec"]["image"] = "mine"
    assert {parse_spec(own, "cpu", "cuda").gpu_image, parse_spec(own, "cpu").image} == {"mine"}
