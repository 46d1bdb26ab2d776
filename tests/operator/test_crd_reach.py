"""Every CRD field does something: it changes what the operator writes (a pod's args or env, a
child object, a Deployment's first replica count), or docs/llmservice-spec.md lists it as
operator-only (read by the operator's autoscaler or status, never by a pod).

A field the schema accepts and nothing reads was how `kvStore.ttlSeconds` lived for months:
written to a ConfigMap, then ignored. Each leaf of the schema is changed, one at a time, to
another valid value, and the operator's output is compared.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from crd_validation import openapi_schema, validate, walk_schema

from cleave.operator.builders import desired_children, owner_reference
from cleave.operator.reconcile import initial_replicas, owned_replicas
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.spec import parse_spec

DOC = Path(__file__).resolve().parents[2] / "docs" / "llmservice-spec.md"
ROLE = {"replicas": 2, "resources": {"requests": {"cpu": "1"}},
        "tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}],
        "engine": {"maxBatchedTokens": 256, "maxNumSeqs": 8, "kvCacheMemory": "1Gi"}}
SCALING = {"minReplicas": 1, "maxReplicas": 4, "tokensPerSecondPerReplica": 1000}
BASE: dict[str, Any] = {
    "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
    "spec": {"model": {"name": "m", "source": "/models/m", "volume": {"claimName": "models"}},
             "prefill": {**ROLE, "autoscaling": {**SCALING, "ttftSeconds": 0.5}},
             "decode": {**ROLE, "autoscaling": {**SCALING, "tpotSeconds": 0.05,
                                                "kvCacheUsage": 0.8}},
             "router": {"apiKeySecret": {"name": "k", "key": "key"},
                        "tolerations": copy.deepcopy(ROLE["tolerations"])},
             "kvStore": {"managed": {"memory": "1Gi"}}, "autoscaling": {"mode": "Disabled"},
             "imagePullSecrets": [{"name": "regcred"}]}}
EXTERNAL = {"external": {"url": "redis://r.infra:6379/0",
                         "passwordSecret": {"name": "rs", "key": "pw"}}}
# Leaves whose changed value the generic rules below cannot make (patterns, free objects).
SAMPLES: dict[str, Any] = {
    "spec.kvStore.external.url": "rediss://other.infra:6380/1",
    "spec.autoscaling.prometheus.url": "http://prometheus.monitoring:9090",
    "spec.prefill.affinity": {"podAntiAffinity": {}},
    "spec.prefill.topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                "whenUnsatisfiable": "DoNotSchedule"}],
    "spec.imagePullSecrets": [{"name": "other"}],
    "spec.model.aliases": ["m-latest"],
    "spec.prefill.podDisruptionBudget.maxUnavailable": "50%",
    "spec.prefill.tolerations[].tolerationSeconds": 60,
    "spec.prefill.tolerations[].effect": "NoExecute",
    "spec.prefill.tolerations[].operator": "Exists",
    "spec.autoscaling.prefillDecodeRatio.min": 0.5,
    "spec.autoscaling.prefillDecodeRatio.max": 3.0,
    "spec.autoscaling.windowSeconds": 120,
    "spec.prefill.resources.limits": {"memory": "3Gi"},
    "spec.prefill.resources.requests": {"memory": "3Gi"},
    "spec.prefill.tolerations": [{"key": "other", "operator": "Exists"}],
}

PASSWORDS = RedisPasswords("adm", "wpw", "rpw")


def leaves() -> list[str]:
    """Every spec field that holds a value (not an object of fields)."""
    found = []
    for path, node in walk_schema(openapi_schema()):
        if not path.startswith("spec.") or "properties" in node:
            continue
        if path.endswith(("{}", "[]")):
            continue  # a map's values / a list's items: their container is the field
        found.append(path)
    return sorted(set(found))


def operator_only() -> set[str]:
    text = DOC.read_text()
    section = text[text.index("## Operator-only fields"):]
    section = section[:section.find("\n## ", 3)]
    return set(re.findall(r"^- `(spec\.[^`]+)`", section, re.M))


def node_at(path: str) -> dict[str, Any]:
    for p, node in walk_schema(openapi_schema()):
        if p == path:
            return node
    raise KeyError(path)


def other_value(path: str, node: dict[str, Any], current: Any) -> Any:
    canonical = re.sub(r"^spec\.(decode|router)\.", "spec.prefill.", path)
    if canonical in SAMPLES:
        return SAMPLES[canonical]
    if current is None:
        current = node.get("default")
    if "enum" in node:
        return next(v for v in node["enum"] if v != current and v != "")
    kind = node.get("type")
    if node.get("x-kubernetes-int-or-string"):
        return "3Gi"
    if kind == "boolean":
        return not current
    if kind in ("integer", "number"):
        low = node.get("minimum", 0)
        value = (current if current is not None else low) + (1 if kind == "integer" else 0.25)
        return min(value, node.get("maximum", value))
    if kind == "string":
        return "changed-" + path.rsplit(".", 1)[-1].lower()
    if kind == "object":  # a map of strings (nodeSelector)
        return {"pool": "changed"}
    raise AssertionError(f"{path}: no rule for a changed value of {node}")


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    target = obj
    for part in parts[:-1]:  # into a list: the base holds one item to change
        target = target[part[:-2]][0] if part.endswith("[]") else target.setdefault(part, {})
    target[parts[-1]] = value


def current(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.split("."):
        if isinstance(value, list):
            value = value[0]
        if not isinstance(value, dict):
            return None
        value = value.get(part.removesuffix("[]"))
    return value


def written(obj: dict[str, Any]) -> str:
    """Everything the operator writes for ``obj``: its children, and the replicas each
    Deployment is created with."""
    spec = parse_spec(obj)
    children = desired_children(spec, owner_reference(obj), PASSWORDS, owned_replicas(spec), "salt",
                                internal_token="tok")
    # Not the <name>-config ConfigMap: no pod reads it (it is for humans), and a field that
    # reached only it was how kvStore.ttlSeconds went ignored.
    children = [c for c in children if c["kind"] != "ConfigMap"]
    return json.dumps([children, initial_replicas(spec)], sort_keys=True)


def base_for(path: str) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    if path.startswith("spec.kvStore.external"):
        obj["spec"]["kvStore"] = copy.deepcopy(EXTERNAL)
    if ".autoscaling." in path and not path.startswith("spec.autoscaling.mode"):
        obj["spec"]["autoscaling"]["mode"] = "Cleave"
    if path.startswith("spec.model.tokenSecret"):  # a hub model: its download uses the token
        obj["spec"]["model"].update(source="org/model", tokenSecret={"name": "hf", "key": "t"})
    if path.startswith("spec.kvStore.saltSecret"):
        obj["spec"]["kvStore"]["saltSecret"] = {"name": "team-salt", "key": "salt"}
    if path.startswith("spec.kvStore.external.tls"):
        ca = "caConfigMap" if ".caConfigMap" in path else "caSecret"
        obj["spec"]["kvStore"]["external"].update(
            url="rediss://r.infra:6380/0",
            tls={ca: {"name": "redis-ca", "key": "ca.pem"}, "serverName": "redis.infra"})
    if path.startswith("spec.autoscaling.prefillDecodeRatio"):
        obj["spec"]["autoscaling"]["prefillDecodeRatio"] = {"min": 0.25, "max": 4}
    return obj


@pytest.mark.parametrize("path", leaves())
def test_every_field_reaches_a_pod_or_a_child_or_is_documented_operator_only(path: str) -> None:
    obj = base_for(path)
    before = written(obj)
    changed = copy.deepcopy(obj)
    set_path(changed, path, other_value(path, node_at(path), current(obj, path)))
    assert validate(changed) == [], (path, validate(changed))
    reaches = written(changed) != before
    documented = path in operator_only()
    assert reaches != documented, (
        f"{path} changes nothing the operator writes: list it under 'Operator-only fields' in "
        "docs/llmservice-spec.md, or make it reach the pods" if not reaches else
        f"{path} reaches the pods, but docs/llmservice-spec.md lists it as operator-only")


def test_the_walk_covers_the_schema() -> None:
    found = leaves()
    assert len(found) > 60
    assert operator_only() <= set(found), operator_only() - set(found)
    print(f"\ncrd fields={len(found)} reach_pods_or_children={len(found) - len(operator_only())}"
          f" operator_only={len(operator_only())}")
