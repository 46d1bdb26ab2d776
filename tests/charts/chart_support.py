"""Shared helpers for the checks of the Helm chart in charts/cleave, with the real helm binary.

helm (v4) comes from tools/fetch-helm.sh, which installs it into .tools/bin; these tests skip
only when that binary is absent. Built-in kinds are validated offline with kubernetes-validate.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cleave"
HELM = REPO / ".tools" / "bin" / "helm"
# The chart's copy of the CRD; it must match the canonical one byte for byte.
CHART_CRD = CHART / "files" / "crds" / "llmservice.yaml"
CANONICAL_CRD = REPO / "crds" / "llmservice.yaml"
METRICS_DOC = REPO / "docs" / "metrics.md"
KUBE_VERSION = "1.35.0"
RELEASE = "cleave"
NAMESPACE = "cleave-system"

requires_helm = pytest.mark.skipif(
    not HELM.is_file(), reason=f"{HELM} not found: run tools/fetch-helm.sh to install helm"
)

# Every optional feature on.
ALL_ON: dict[str, Any] = {
    "operator": {
        "logLevel": "debug",
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                            ]
                        }
                    ]
                }
            }
        },
    },
    "serviceAccount": {
        "create": True,
        "name": "cleave-custom-sa",
        "annotations": {"example.com/role": "cleave-operator"},
    },
    "crds": {"install": True, "keep": True},
    "runtime": {"image": "registry.example.com/cleave-runtime:9.9.9"},
    "monitoring": {
        "serviceMonitor": {
            "enabled": True,
            "interval": "30s",
            "labels": {"release": "kube-prometheus-stack"},
        },
        "grafanaDashboard": {"enabled": True, "labels": {"team": "ml"}},
    },
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def template(
    values: dict[str, Any] | None = None, *extra: str, tmp_path: Path | None = None
) -> list[dict[str, Any]]:
    args = [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *extra,
    ]
    if values is not None:
        assert tmp_path is not None
        values_file = tmp_path / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        args += ["-f", str(values_file)]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    return deployment


def validate_builtin(docs: list[dict[str, Any]]) -> int:
    """Validate every built-in kind against the Kubernetes 1.35 schemas; return the count."""
    checked = 0
    for doc in docs:
        if doc["apiVersion"].split("/")[0] == "monitoring.coreos.com":
            continue  # a CRD-based kind (Prometheus Operator): no built-in schema
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    return checked
