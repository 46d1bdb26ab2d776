"""The chart's templated LLMService CRD: faithful, installed once, and toggleable."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from chart_support import (
    CANONICAL_CRD,
    CHART,
    CHART_CRD,
    KUBE_VERSION,
    REPO,
    by_kind,
    requires_helm,
    template,
)

# --- the CRD -----------------------------------------------------------------------------


@requires_helm
def test_crd_is_apiextensions_v1_and_faithful(default_docs: list[dict[str, Any]]) -> None:
    (crd,) = by_kind(default_docs, "CustomResourceDefinition")
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)
    assert crd["metadata"]["name"] == "llmservices.cleave.dev"
    assert crd["spec"]["group"] == "cleave.dev"
    assert crd["spec"]["names"]["kind"] == "LLMService"
    # The template round-trips the file through fromYaml/toYaml: nothing may change but the
    # labels and annotations it adds.
    source = yaml.safe_load(CHART_CRD.read_text())
    assert crd["spec"] == source["spec"]
    for key, value in (source["metadata"].get("labels") or {}).items():
        if key != "app.kubernetes.io/component":
            assert crd["metadata"]["labels"][key] == value
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # crds.keep


@requires_helm
def test_crd_appears_once_with_and_without_include_crds() -> None:
    for extra in ([], ["--include-crds"]):
        docs = template(None, *extra)
        assert len(by_kind(docs, "CustomResourceDefinition")) == 1, extra
    # Helm's special crds/ folder would install a second copy before the templates.
    assert not (CHART / "crds").exists(), (
        "charts/cleave/crds/ must not exist: the CRD is templated from files/crds/"
    )


@requires_helm
def test_crd_install_and_keep_toggles(tmp_path: Path) -> None:
    assert not by_kind(
        template({"crds": {"install": False}}, tmp_path=tmp_path), "CustomResourceDefinition"
    )
    (crd,) = by_kind(
        template({"crds": {"keep": False}}, tmp_path=tmp_path), "CustomResourceDefinition"
    )
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})


def test_chart_crd_matches_canonical() -> None:
    """charts/cleave/files/crds/llmservice.yaml is a byte-for-byte copy of crds/llmservice.yaml."""
    assert CANONICAL_CRD.is_file(), f"{CANONICAL_CRD} is missing"
    assert CHART_CRD.is_file(), f"{CHART_CRD} is missing"
    assert CHART_CRD.read_bytes() == CANONICAL_CRD.read_bytes(), (
        f"{CHART_CRD.relative_to(REPO)} has drifted from {CANONICAL_CRD.relative_to(REPO)}: "
        f"cp {CANONICAL_CRD.relative_to(REPO)} {CHART_CRD.relative_to(REPO)}"
    )
