"""The chart's values.yaml and values.schema.json: strict, complete and commented."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from chart_support import (
    CHART,
    KUBE_VERSION,
    RELEASE,
    helm,
    requires_helm,
)

# --- values schema -----------------------------------------------------------------------


@requires_helm
@pytest.mark.parametrize(
    "bad",
    [
        ["--set", "operator.replicas=-1"],
        ["--set", "operator.replicas=2"],  # standalone kopf: at most one operator
        ["--set", "operator.unknownKey=1"],
        ["--set", "notAValue=1"],
        ["--set", "operator.logLevel=loud"],
        ["--set", "operator.image.pullPolicy=Sometimes"],
        ["--set-string", "crds.install=yes"],
        ["--set", "monitoring.serviceMonitor.interval=soon"],
        ["--set-json", 'operator.watchNamespaces=["team-*"]'],
        ["--set", "monitoring.grafanaDashboard.extra=true"],
        ["--set", "operator.metricsPort=70000"],
    ],
    ids=lambda bad: bad[1],
)
def test_schema_rejects_bad_values(bad: list[str]) -> None:
    result = helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *bad)
    assert result.returncode != 0
    assert "schema" in result.stderr, result.stderr


@requires_helm
def test_schema_accepts_global_values() -> None:
    # A parent chart passes `global`; additionalProperties: false must not reject it.
    result = helm(
        "template",
        RELEASE,
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "global.imageRegistry=registry.example.com",
    )
    assert result.returncode == 0, result.stderr


def test_every_value_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], sub: dict[str, Any], path: str) -> None:
        assert sub.get("type") == "object", path
        props = sub.get("properties")
        if props is None:
            return  # a free-form Kubernetes struct (affinity, securityContext, ...)
        assert sub.get("additionalProperties") is False, path
        for key, value in node.items():
            assert key in props, f"{path}.{key} is not in values.schema.json"
            if isinstance(value, dict) and "properties" in props[key]:
                walk(value, props[key], f"{path}.{key}")

    walk(values, schema, "")


def test_every_value_is_commented() -> None:
    """Each key of values.yaml has a comment, or is a section whose own keys all do."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    commented: dict[tuple[str, ...], bool] = {}
    stack: list[str] = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_]\w*):", line)
        if match:
            stack = [*stack[: len(match.group(1)) // 2], match.group(2)]
            commented[tuple(stack)] = lines[i - 1].lstrip().startswith("#")

    def check(node: dict[str, Any], sub: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if commented[here]:
                continue
            prop = sub["properties"][key]
            assert isinstance(value, dict) and "properties" in prop, f"{here} has no comment"
            check(value, prop, here)

    check(values, schema, ())
