"""The CRD is generated from cleave.operator.crd_schema: the committed YAML matches the module,
and every field under spec and status says what it does (``kubectl explain`` shows it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import walk_schema

from cleave.operator.crd_schema import HEADER, crd, render

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [ROOT / "crds" / "llmservice.yaml",
             ROOT / "charts" / "cleave" / "files" / "crds" / "llmservice.yaml"]


def schema() -> dict[str, Any]:
    [version] = crd()["spec"]["versions"]
    root: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return root


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_crd_is_the_generated_one(path: Path) -> None:
    assert yaml.safe_load(path.read_text()) == crd(), (
        f"{path.relative_to(ROOT)} differs from operator/cleave/operator/crd_schema.py: edit "
        "the module, then run `make crds`")
    assert path.read_text().startswith(HEADER), f"run `make crds` to regenerate {path}"


def test_the_writer_prints_the_document_and_needs_no_third_party_module_to_build_it() -> None:
    """``crd()`` is stdlib only (no torch, not even PyYAML); ``python -m`` prints the YAML."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator")}
    probe = ("import sys; from cleave.operator.crd_schema import crd; crd(); "
             "print(sorted(m for m in ('yaml', 'torch', 'kopf', 'kubernetes') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
    printed = subprocess.run([sys.executable, "-m", "cleave.operator.crd_schema"], env=env,
                             capture_output=True, text=True, check=True).stdout
    assert printed == render()
    assert printed.startswith("# GENERATED") and yaml.safe_load(printed) == crd()


def described_nodes() -> list[tuple[str, dict[str, Any], bool]]:
    """(path, node, needs a description) for every node under spec and status.

    The items of a list (``tolerations[]``) and the values of a map (``limits{}``) need none
    when the list or map itself is described: kubectl explain prints the field's description
    and then the item's (skipping an empty one), and a path cannot name an item alone, so an
    item's own text would only repeat its list's. The fields inside an item do need one. The
    int-or-string ``anyOf`` branches of a quantity share their parent's path and must not
    carry a description (structural schema rule), so the first node seen at a path counts."""
    seen: dict[str, dict[str, Any]] = {}
    for path, node in walk_schema(schema()):
        if path.split(".")[0] in ("spec", "status"):
            seen.setdefault(path, node)
    out = []
    for path, node in seen.items():
        container = path[:-2] if path.endswith(("[]", "{}")) else None
        exempt = container is not None and bool(seen[container].get("description"))
        out.append((path, node, not exempt))
    return out


def test_every_field_under_spec_and_status_has_a_description() -> None:
    nodes = described_nodes()
    assert len(nodes) > 100
    missing = [p for p, node, needs in nodes
               if needs and not str(node.get("description", "")).strip()]
    assert not missing, f"no description (add one in crd_schema.py): {missing}"
    for path, node, _ in nodes:
        for sub in node.get("anyOf", []):
            assert "description" not in sub, f"{path}: anyOf branches take no description"


def test_descriptions_state_the_schema_defaults() -> None:
    """A field with a scalar default says it in words, with the same value."""
    checked = 0
    for path, node, _ in described_nodes():
        default = node.get("default")
        if default is None or isinstance(default, dict):
            continue
        words = str(default).lower() if isinstance(default, bool) else str(default)
        assert f"Default {words}." in node["description"], (path, default)
        checked += 1
    assert checked >= 15


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def test_prefill_and_decode_share_everything_but_their_targets() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    prefill, decode = (strip_descriptions(spec[r]) for r in ("prefill", "decode"))
    p_scaling = prefill["properties"].pop("autoscaling")
    d_scaling = decode["properties"].pop("autoscaling")
    assert prefill == decode
    targets = {"prefill": {"ttftSeconds"}, "decode": {"tpotSeconds", "kvCacheUsage"}}
    for scaling, role in ((p_scaling, "prefill"), (d_scaling, "decode")):
        [cel] = scaling.pop("x-kubernetes-validations")
        assert cel["message"].startswith(f"{role}.autoscaling.")
        for target in targets[role]:
            scaling["properties"].pop(target)
    assert p_scaling == d_scaling


def test_printer_columns() -> None:
    [version] = crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Model"]["jsonPath"] == ".spec.model.name"
    assert list(columns)[-1] == "Age"
    assert {"Prefill", "Decode", "Endpoint"} <= set(columns)
