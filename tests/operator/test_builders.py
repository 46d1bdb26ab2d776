"""Desired state: an LLMService spec -> its children, as pure functions."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from cleave.operator.builders import (
    desired_children,
    endpoint,
    owner_reference,
    worker_deployment,
)
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


def build(obj: dict[str, Any], replicas: dict[str, int | None] | None = None
          ) -> dict[str, dict[str, Any]]:
    spec = parse_spec(obj)
    children = desired_children(spec, owner_reference(obj), "pw",
                                replicas or {"prefill": 2, "decode": 3})
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def test_every_child_is_owned_labelled_and_named_after_the_service() -> None:
    children = build(BASE)
    assert set(children) == {
        "ConfigMap/chat-config", "Secret/chat-redis-auth", "Service/chat-redis",
        "StatefulSet/chat-redis", "Deployment/chat-prefill", "Service/chat-prefill",
        "Deployment/chat-decode", "Service/chat-decode", "Deployment/chat-router",
        "Service/chat-router"}
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
    assert "--device" in container["args"] and "cuda" in container["args"]
    decode = children["Deployment/chat-decode"]
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-cache-memory") + 1] == "4Gi"
    assert args[args.index("--role") + 1] == "decode"
    assert "--device" not in args  # no GPU asked for: the runtime picks the CPU


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
    args = children["Deployment/chat-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prefill") + 1] == "dns+http://chat-prefill.ml.svc:8100"
    assert args[args.index("--decode") + 1] == "dns+http://chat-decode.ml.svc:8100"
    assert endpoint(parse_spec(BASE)) == "http://chat-router.ml.svc:8000/v1"


@pytest.mark.parametrize("spec", [
    {"model": {"name": "m", "source": "s"}, "decode": {}, "kvStore": "x"},
    {"model": {"name": "m", "source": "s"}, "decode": "two"},
    {"model": {"name": "m", "source": "s"}, "decode": {"autoscaling": []}},
    {"model": ["m"], "decode": {}},
])
def test_wrongly_shaped_specs_are_spec_errors_not_crashes(spec: dict[str, Any]) -> None:
    with pytest.raises(SpecError):
        parse_spec({"metadata": {"name": "a", "namespace": "d"}, "spec": spec})


def test_router_holds_requests_only_when_roles_can_scale_to_zero() -> None:
    def router_args(obj: dict[str, Any]) -> list[str]:
        c = build(obj)["Deployment/chat-router"]["spec"]["template"]["spec"]["containers"][0]
        return list(c["args"])

    assert "--hold-timeout" not in router_args(BASE)  # no hold: a fast 503 when workers are gone
    to_zero = copy.deepcopy(BASE)
    to_zero["spec"]["autoscaling"] = {"scaleToZero": True}
    args = router_args(to_zero)
    assert float(args[args.index("--hold-timeout") + 1]) >= 60
    to_zero["spec"]["autoscaling"]["mode"] = "External"  # nobody here wakes the roles
    assert "--hold-timeout" not in router_args(to_zero)


def test_managed_redis_password_flows_from_its_secret() -> None:
    children = build(BASE)
    assert children["Secret/chat-redis-auth"]["stringData"] == {"password": "pw"}
    env = children["Deployment/chat-decode"]["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "CLEAVE_REDIS_PASSWORD")["valueFrom"]
    assert ref == {"secretKeyRef": {"name": "chat-redis-auth", "key": "password"}}
    redis = children["StatefulSet/chat-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis["command"][-1]
    assert "pw" not in json.dumps(redis)  # the password is never inlined in a pod spec
    assert "--maxmemory 858993459" in redis["command"][-1]  # 80 % of 1Gi


def test_external_redis_uses_the_users_secret_and_no_managed_children() -> None:
    obj = copy.deepcopy(BASE)
    obj["spec"]["kvStore"] = {"external": {"url": "rediss://cache.infra:6380/0",
                                           "passwordSecret": {"name": "rs", "key": "pass"}}}
    children = build(obj)
    assert not any("redis" in k for k in children)
    container = children["Deployment/chat-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--redis-url") + 1].startswith("rediss://")
    ref = next(e for e in container["env"] if e["name"] == "CLEAVE_REDIS_PASSWORD")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "rs", "key": "pass"}


def test_replicas_left_out_when_someone_else_owns_them() -> None:
    children = build(BASE, {"prefill": None, "decode": 5})
    assert "replicas" not in children["Deployment/chat-prefill"]["spec"]
    assert children["Deployment/chat-decode"]["spec"]["replicas"] == 5


def test_decode_only_service_has_no_prefill_children() -> None:
    obj = copy.deepcopy(BASE)
    del obj["spec"]["prefill"]
    children = build(obj)
    assert "Deployment/chat-prefill" not in children
    args = children["Deployment/chat-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prefill" not in args


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
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "chat"


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
