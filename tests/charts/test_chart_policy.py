"""The chart's RBAC and the operator pod's security, command, env and probes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from chart_support import (
    CHART,
    by_kind,
    operator_deployment,
    requires_helm,
)

# --- RBAC and pod security -------------------------------------------------------------


@requires_helm
def test_rbac_has_no_wildcards(all_on_docs: list[dict[str, Any]]) -> None:
    roles = by_kind(all_on_docs, "ClusterRole") + by_kind(all_on_docs, "Role")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
                assert not any("*" in item for item in rule.get(field, [])), rule


@requires_helm
def test_rbac_grants_what_the_operator_needs(default_docs: list[dict[str, Any]]) -> None:
    granted: dict[tuple[str, str], set[str]] = {}
    for role in by_kind(default_docs, "ClusterRole"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    # Exactly the verbs the code calls (issue 15): kube.py's get/create/patch/delete, its
    # label-selected lists, the Scale patch, kopf's watch of LLMServices, its status patches
    # and event posts; Secrets only read by name and created (a list would read them all).
    children = {"get", "list", "create", "patch", "delete"}
    assert granted == {
        ("cleave.dev", "llmservices"): {"list", "watch", "patch"},
        ("cleave.dev", "llmservices/status"): {"patch"},
        ("cleave.dev", "llmservices/finalizers"): {"update"},
        ("apps", "deployments"): children, ("apps", "statefulsets"): children,
        ("apps", "deployments/scale"): {"patch"},
        ("", "services"): children, ("", "configmaps"): children - {"delete"},
        ("", "secrets"): {"get", "create"},
        ("", "pods"): {"list"},
        ("autoscaling", "horizontalpodautoscalers"): {"list"},
        ("policy", "poddisruptionbudgets"): children,
        ("networking.k8s.io", "networkpolicies"): children,
        ("", "events"): {"create"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    }


def test_every_rbac_rule_is_commented() -> None:
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    rule_lines = [i for i, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert rule_lines
    for i in rule_lines:
        assert lines[i - 1].strip().startswith("#"), f"rbac.yaml:{i + 1} has no comment"


@requires_helm
def test_operator_pod_is_locked_down(default_docs: list[dict[str, Any]]) -> None:
    deployment = operator_deployment(default_docs)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]
    # A writable /tmp, since the root filesystem is read-only.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


@requires_helm
def test_operator_command_env_and_probes(default_docs: list[dict[str, Any]]) -> None:
    (container,) = operator_deployment(default_docs)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/cleave-dev/cleave-operator:0.1.0"
    assert container["command"] == ["cleave", "operator"]
    assert "--standalone" in container["args"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert "--all-namespaces" in container["args"]
    assert "--metrics-port=9090" in container["args"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["CLEAVE_RUNTIME_IMAGE"] == "ghcr.io/cleave-dev/cleave-runtime:0.1.0"
    assert env["CLEAVE_RUNTIME_GPU_IMAGE"] == "ghcr.io/cleave-dev/cleave-runtime:0.1.0-cu128"
    assert env["CLEAVE_LOG_LEVEL"] == "info"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}


@requires_helm
def test_the_operator_learns_who_may_scrape_the_workers(default_docs: list[dict[str, Any]]
                                                        ) -> None:
    """The NetworkPolicies the operator writes let these peers reach the workers' /metrics."""
    import json

    (container,) = operator_deployment(default_docs)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert json.loads(env["CLEAVE_METRICS_PEERS"]) == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "prometheus"}}}]
