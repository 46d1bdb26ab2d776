"""The Helm chart lints, renders what its values ask for, and validates offline."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from chart_support import (
    CHART,
    KUBE_VERSION,
    METRICS_DOC,
    NAMESPACE,
    by_kind,
    helm,
    operator_deployment,
    requires_helm,
    template,
    validate_builtin,
)

from cleave.common import metric_names as names

# --- lint and render ----------------------------------------------------------------------


@requires_helm
@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint(strict: bool) -> None:
    result = helm(
        "lint", str(CHART), "--kube-version", KUBE_VERSION, *(["--strict"] if strict else [])
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@requires_helm
def test_default_render(default_docs: list[dict[str, Any]]) -> None:
    kinds = sorted(doc["kind"] for doc in default_docs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Deployment",
            "CustomResourceDefinition",
        ]
    )
    # Monitoring is off by default.
    assert not by_kind(default_docs, "ServiceMonitor")
    assert not by_kind(default_docs, "PodMonitor")
    assert not by_kind(default_docs, "ConfigMap")


@requires_helm
def test_all_features_render(all_on_docs: list[dict[str, Any]]) -> None:
    (sa,) = by_kind(all_on_docs, "ServiceAccount")
    assert sa["metadata"]["name"] == "cleave-custom-sa"
    assert sa["metadata"]["annotations"] == {"example.com/role": "cleave-operator"}
    pod = operator_deployment(all_on_docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cleave-custom-sa"
    for binding in by_kind(all_on_docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "cleave-custom-sa", "namespace": NAMESPACE}
        ]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert "nodeAffinity" in pod["affinity"]
    (crd,) = by_kind(all_on_docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (monitor,) = by_kind(all_on_docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    # The operator's own metrics (the autoscaler's) are scraped from its pod.
    (pod_monitor,) = by_kind(all_on_docs, "PodMonitor")
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert (pod_endpoint["port"], pod_endpoint["path"], pod_endpoint["honorLabels"]) == (
        "metrics", "/metrics", True)
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (dashboard,) = by_kind(all_on_docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["labels"]["team"] == "ml"
    container = pod["containers"][0]
    assert "--debug" in container["args"]


@requires_helm
def test_operator_metrics_port_can_be_turned_off(tmp_path: Path) -> None:
    docs = template({"operator": {"metricsPort": 0},
                     "monitoring": {"serviceMonitor": {"enabled": True}}}, tmp_path=tmp_path)
    (container,) = operator_deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=0" in container["args"]
    assert [p["name"] for p in container["ports"]] == ["healthz"]
    assert not by_kind(docs, "PodMonitor") and by_kind(docs, "ServiceMonitor")


@requires_helm
def test_existing_service_account(tmp_path: Path) -> None:
    docs = template({"serviceAccount": {"create": False, "name": "preexisting"}}, tmp_path=tmp_path)
    assert not by_kind(docs, "ServiceAccount")
    pod = operator_deployment(docs)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "preexisting"


@requires_helm
def test_rbac_can_be_disabled(tmp_path: Path) -> None:
    docs = template({"rbac": {"create": False}}, tmp_path=tmp_path)
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]


@requires_helm
def test_watch_namespaces_scope_rbac_and_args(tmp_path: Path) -> None:
    docs = template(
        {
            "operator": {"watchNamespaces": ["team-a", "team-b"]},
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
        tmp_path=tmp_path,
    )
    args = operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    role_bindings = by_kind(docs, "RoleBinding")
    assert sorted(rb["metadata"]["namespace"] for rb in role_bindings) == ["team-a", "team-b"]
    # Only the cluster-scoped CRD read stays cluster-wide.
    (crb,) = by_kind(docs, "ClusterRoleBinding")
    assert crb["roleRef"]["name"].endswith("-operator-crds")
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


# --- offline schema validation ----------------------------------------------------------

@requires_helm
def test_default_render_validates(default_docs: list[dict[str, Any]]) -> None:
    assert validate_builtin(default_docs) == len(default_docs)


@requires_helm
def test_all_features_render_validates(all_on_docs: list[dict[str, Any]]) -> None:
    # all but the ServiceMonitor and the PodMonitor (Prometheus Operator kinds)
    assert validate_builtin(all_on_docs) == len(all_on_docs) - 2


@requires_helm
def test_watch_namespaces_render_validates(tmp_path: Path) -> None:
    docs = template({"operator": {"watchNamespaces": ["team-a"]}}, tmp_path=tmp_path)
    assert validate_builtin(docs) == len(docs)

# --- Grafana dashboard -------------------------------------------------------------------


@requires_helm
def test_dashboard_json(all_on_docs: list[dict[str, Any]]) -> None:
    (configmap,) = by_kind(all_on_docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (raw,) = configmap["data"].values()
    dashboard = json.loads(raw)
    assert dashboard == json.loads((CHART / "dashboards" / "cleave.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["targets"] for p in panels)
    assert all("cleave_" in " ".join(t["expr"] for t in p["targets"]) for p in panels)
    text = "\n".join(exprs)
    for metric in (
        names.bucket(names.TTFT),
        names.bucket(names.TPOT),
        names.KV_USAGE,
        names.total(names.STORE_HITS),
        names.total(names.STORE_MISSES),
        names.total(names.KV_RECOMPUTE_FALLBACKS),
    ):
        assert metric in text, metric
    assert "histogram_quantile(0.5" in text and "histogram_quantile(0.9" in text
    # Every cleave_ metric the dashboard uses is documented.
    documented = METRICS_DOC.read_text()
    for name in set(re.findall(r"\bcleave_\w+", text)):
        base = re.sub(r"_bucket$", "", name)
        assert base in documented, name
