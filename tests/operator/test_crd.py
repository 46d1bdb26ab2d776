"""The LLMService CRD (crds/llmservice.yaml) against docs/llmservice-spec.md, and the examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import (
    apply_defaults,
    evaluate_rule,
    load_crd,
    minimal,
    openapi_schema,
    to_json_schema,
    validate,
    walk_schema,
    with_spec,
)
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def llm_services(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "LLMService"]


# --- the CRD document ---------------------------------------------------------------------


def test_crd_document() -> None:
    crd = load_crd()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "llmservices.cleave.dev"
    spec = crd["spec"]
    assert spec["group"] == "cleave.dev"
    assert spec["scope"] == "Namespaced"
    names = spec["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (
        "LLMService", "llmservices", "llmservice")
    assert names["shortNames"] == ["llms"]
    [version] = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["served"] is True and version["storage"] is True
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Model", "Prefill", "Decode", "Endpoint", "Age"]
    assert columns["Prefill"]["jsonPath"] == ".status.prefill.readyReplicas"
    assert columns["Decode"]["jsonPath"] == ".status.decode.readyReplicas"
    assert columns["Endpoint"]["jsonPath"] == ".status.endpoint"
    assert columns["Age"] == {"name": "Age", "type": "date",
                              "jsonPath": ".metadata.creationTimestamp"}
    for column in columns.values():
        assert column["type"] in {"integer", "number", "string", "boolean", "date"}


def test_schema_required_fields_and_status() -> None:
    schema = openapi_schema()
    spec = schema["properties"]["spec"]
    assert set(spec["required"]) == {"model", "decode", "kvStore"}
    assert set(spec["properties"]["model"]["required"]) == {"name", "source"}
    status = schema["properties"]["status"]["properties"]
    assert set(status) >= {"observedGeneration", "endpoint", "prefill", "decode", "router",
                           "conditions", "autoscaler"}
    condition = status["conditions"]["items"]["properties"]
    assert condition["type"]["enum"] == ["Ready", "Progressing", "Degraded"]
    assert condition["status"]["enum"] == ["True", "False", "Unknown"]
    autoscaler = status["autoscaler"]["properties"]
    assert set(autoscaler) == {"dryRun", "desiredReplicas", "decisions"}
    assert autoscaler["decisions"]["maxItems"] == 10
    decision = autoscaler["decisions"]["items"]["properties"]
    assert set(decision) == {"time", "role", "current", "desired", "reason", "advisory",
                             "inputs"}


def test_schema_is_structural() -> None:
    """What the apiserver demands of a structural schema, as far as kubectl cares."""
    for path, node in walk_schema(openapi_schema()):
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        if not int_or_string:
            assert "type" in node, f"{path or '<root>'} has no type"
        if int_or_string:
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
        if node.get("type") == "object":
            assert not ("properties" in node and "additionalProperties" in node), path
            if "properties" not in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                assert path == "metadata", f"{path} is an object that prunes everything"
        if node.get("type") == "array":
            assert "items" in node and "type" in node["items"], path
        # Only the pod-spec fields passed to pods as written keep unknown fields: the
        # apiserver checks them as core/v1 types when the Deployment is written
        # (test_builders validates the built Deployments against the core/v1 schema).
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert path.rsplit(".", 1)[-1] in ("affinity", "topologySpreadConstraints[]"), (
                f"{path}: no other field needs x-kubernetes-preserve-unknown-fields")
        for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
            if keyword in node:
                assert isinstance(node[keyword], bool), f"{path}: {keyword} is a bool in v1 CRDs"
                assert ("minimum" if keyword == "exclusiveMinimum" else "maximum") in node, path
        for required in node.get("required", []):
            assert required in node.get("properties", {}), f"{path}: {required} not a property"


def test_defaults_validate_against_their_schema() -> None:
    """The apiserver rejects a CRD whose defaults fail their own schema."""
    defaults = [(p, n) for p, n in walk_schema(openapi_schema()) if "default" in n]
    assert defaults
    for path, node in defaults:
        errors = list(Draft202012Validator(to_json_schema(node)).iter_errors(
            apply_defaults(node["default"], node)))
        assert not errors, (path, [e.message for e in errors])


def test_every_rule_compiles_and_has_a_message() -> None:
    rules = [(p, r) for p, n in walk_schema(openapi_schema())
             for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) == 12
    for path, rule in rules:
        assert rule.get("message"), path
        # a rule that does not compile raises here; evaluation errors just count as failures
        evaluate_rule(rule["rule"], {})


# --- examples -----------------------------------------------------------------------------


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"cpu-smollm2.yaml", "gpu-service.yaml",
                                          "external-redis.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path) -> None:
    services = llm_services(path)
    assert services
    for obj in services:
        assert obj["apiVersion"] == "cleave.dev/v1alpha1"
        assert validate(obj) == []


def test_gpu_example_shape() -> None:
    [obj] = llm_services(ROOT / "examples" / "gpu-service.yaml")
    spec = obj["spec"]
    for role in ("prefill", "decode"):
        block = spec[role]
        assert "nvidia.com/gpu" in block["resources"]["limits"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in block["tolerations"]
        assert block["nodeSelector"]
        assert block["autoscaling"]["maxReplicas"] >= block["autoscaling"]["minReplicas"]
    assert spec["autoscaling"]["gpuBudget"] > 0


def test_external_redis_example_has_its_secret() -> None:
    docs = list(yaml.safe_load_all((ROOT / "examples" / "external-redis.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["LLMService", "Secret"]
    ref = docs[0]["spec"]["kvStore"]["external"]["passwordSecret"]
    secret = docs[1]
    assert secret["apiVersion"] == "v1"
    assert secret["metadata"]["name"] == ref["name"]
    assert secret["metadata"]["namespace"] == docs[0]["metadata"]["namespace"]
    assert ref["key"] in secret["stringData"]


def test_cpu_example_is_cpu_only() -> None:
    [obj] = llm_services(ROOT / "examples" / "cpu-smollm2.yaml")
    spec = obj["spec"]
    assert "smollm2" in spec["model"]["source"]
    assert "managed" in spec["kvStore"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(obj)
    # Any CPU: a pinned bfloat16 is refused by every worker on CPUs without AMX/AVX512-BF16
    # (AVX2-only machines, this project's CI among them), and the pods crash-loop.
    assert spec["model"].get("dtype", "auto") == "auto"


# --- defaults -----------------------------------------------------------------------------


def test_defaults_are_applied() -> None:
    spec = apply_defaults(with_spec(prefill={}))["spec"]
    # No default image: the operator's (the chart's runtime.image) applies, so a chart upgrade
    # rolls services that never set one.
    assert "image" not in spec
    assert spec["model"]["dtype"] == "auto"
    assert spec["prefill"]["replicas"] == 1
    assert spec["decode"]["replicas"] == 1
    assert spec["router"] == {"replicas": 1, "port": 8000, "serviceType": "ClusterIP",
                              "disaggregateMinTokens": 64, "kvLoadFailurePolicy": "recompute",
                              "allowUnauthenticated": False,
                              "startupTimeoutSeconds": 600}
    assert spec["kvStore"]["ttlSeconds"] == 3600
    assert spec["autoscaling"] == {"mode": "Cleave", "scaleToZero": False,
                                   "intervalSeconds": 15, "windowSeconds": 60,
                                   "scaleDownDelaySeconds": 300, "dryRun": False}
    assert "gpuBudget" not in spec["autoscaling"]


def test_defaults_keep_explicit_values() -> None:
    spec = apply_defaults(with_spec(decode__replicas=0, router={"port": 9000},
                                    autoscaling={"mode": "Disabled"}))["spec"]
    assert spec["decode"]["replicas"] == 0
    assert spec["router"]["port"] == 9000
    assert spec["router"]["replicas"] == 1
    assert spec["autoscaling"]["mode"] == "Disabled"


def test_status_validates() -> None:
    obj = minimal()
    obj["status"] = {
        "observedGeneration": 3,
        "endpoint": "http://chat-router.default.svc:8000/v1",
        "prefill": {"desiredReplicas": 1, "readyReplicas": 1},
        "decode": {"desiredReplicas": 2, "readyReplicas": 1},
        "router": {"desiredReplicas": 1, "readyReplicas": 1},
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady", "message": "",
                        "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 3}],
        "autoscaler": {"dryRun": False, "desiredReplicas": {"decode": 2}, "decisions": [
            {"time": "2025-01-01T00:00:00Z", "role": "decode", "current": 1, "desired": 2,
             "reason": "tpot asks for 2; up to 2 (window 2, step 4)", "advisory": False,
             "inputs": {"latency_p90": "0.09", "latency_target": "0.05"}}]},
    }
    assert validate(obj) == []
    obj["status"]["conditions"][0]["status"] = "Yes"
    assert any(e.startswith("status.conditions[0].status:") for e in validate(obj))
    obj["status"]["conditions"][0]["status"] = "True"
    obj["status"]["autoscaler"]["decisions"][0]["role"] = "router"
    assert any(e.startswith("status.autoscaler.decisions[0].role:") for e in validate(obj))


def test_autoscaler_options_are_valid() -> None:
    obj = with_spec(decode__autoscaling={"minReplicas": 1, "maxReplicas": 4, "tpotSeconds": 0.05},
                    autoscaling={"intervalSeconds": 10, "windowSeconds": 10,
                                 "scaleDownDelaySeconds": 0, "dryRun": True,
                                 "prometheus": {"url": "http://prometheus.monitoring:9090"}})
    assert validate(obj) == []


def test_capacity_prior_and_cold_start_are_valid() -> None:
    obj = with_spec(prefill__autoscaling={"maxReplicas": 4, "tokensPerSecondPerReplica": 20000},
                    decode__autoscaling={"maxReplicas": 8, "tokensPerSecondPerReplica": 0.5},
                    autoscaling={"coldStartSeconds": 0})
    assert validate(obj) == []
    obj["spec"]["autoscaling"]["coldStartSeconds"] = 120.5
    assert validate(obj) == []
    spec = apply_defaults(with_spec(decode__autoscaling={"maxReplicas": 2}))["spec"]
    assert "coldStartSeconds" not in spec["autoscaling"]  # unset means no rise headroom
    assert "tokensPerSecondPerReplica" not in spec["decode"]["autoscaling"]


def test_the_prefill_decode_ratio_guard_is_checked_by_the_api_server() -> None:
    obj = with_spec(decode__autoscaling={"maxReplicas": 4},
                    autoscaling={"prefillDecodeRatio": {"min": 0.5, "max": 2}})
    assert validate(obj) == []
    for bad in ({"min": 2, "max": 1}, {"min": 0, "max": 1}, {"min": 1}):
        obj["spec"]["autoscaling"]["prefillDecodeRatio"] = bad
        assert validate(obj) != [], bad


@pytest.mark.parametrize(("name", "ok"), [
    ("chat", True), ("a" * 40, True), ("llama-8b", True), ("Chat", False), ("1chat", False),
    ("chat-", False), ("chat.bot", False), ("a" * 41, False)])
def test_names_that_cannot_name_the_children_are_rejected_by_the_api_server(
        name: str, ok: bool) -> None:
    """A name that makes an invalid Service name used to be accepted, and kopf then retried
    creating the children forever with no status."""
    obj = with_spec()
    obj["metadata"]["name"] = name
    errors = validate(obj)
    assert (errors == []) == ok, errors
    if not ok:
        assert any("metadata.name" in e for e in errors)


@pytest.mark.parametrize(("url", "ok"), [
    ("redis://r.infra:6379/0", True), ("rediss://user@r.infra:6380/0", True),
    ("unix:///run/redis.sock", True), ("redis://:hunter2@r.infra:6379/0", False),
    ("redis://user:hunter2@r.infra:6379/0", False), ("redis://r.infra:6379/0?password=x", False)])
def test_a_redis_url_with_a_password_is_rejected(url: str, ok: bool) -> None:
    """The URL goes on every pod's command line, where any user of the node can read it."""
    obj = with_spec(kvStore={"external": {"url": url}})
    assert (validate(obj) == []) == ok, validate(obj)
