"""Fuzzing the LLMService CRD: generated invalid specs are rejected at admission.

Each case takes the minimal valid LLMService and breaks it in one way the schema forbids,
found by walking ``crds/llmservice.yaml`` itself: a wrong JSON type, a number outside its
range, a string outside its enum or pattern or length, an unknown field, a required field left
out, or one of the CEL rules broken (autoscaling min above max, both or neither Redis, a
window shorter than the scrape interval, an empty model source). The check is the apiserver's:
defaults, the openAPIV3Schema, then every CEL rule (``tests/operator/crd_validation.py``).
"""

from __future__ import annotations

import copy
import itertools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import report
from fuzzing import SCALE, fuzz
from hypothesis import strategies as st

sys.path.append(str(Path(__file__).parents[1] / "operator"))

from crd_validation import openapi_schema, validate

Schema = dict[str, Any]
Path_ = tuple[str | int, ...]  # dict keys and list indexes from the object's root
SAMPLES: dict[str, Any] = {"string": "x", "integer": 7, "number": 2.5, "boolean": True,
                           "object": {"a": "b"}, "array": ["a"]}
COMPATIBLE = {"integer": {"integer"}, "number": {"integer", "number"}}


def minimal() -> dict[str, Any]:
    return {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "default"},
            "spec": {"model": {"name": "smollm2-135m-instruct",
                               "source": "smollm2-135m-instruct"},
                     "decode": {}, "kvStore": {"managed": {}}}}


@dataclass(frozen=True)
class Node:
    path: Path_
    schema: Schema


def nodes(schema: Schema, path: Path_) -> Iterator[Node]:
    """Every schema node under ``spec`` that an object can reach, with a concrete path to it
    (lists and maps get one element, ``0`` or ``"k"``)."""
    yield Node(path, schema)
    for name, sub in schema.get("properties", {}).items():
        yield from nodes(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from nodes(schema["items"], (*path, 0))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from nodes(schema["additionalProperties"], (*path, "k"))


def put(obj: dict[str, Any], path: Path_, value: Any) -> dict[str, Any]:
    """A copy of ``obj`` with ``value`` at ``path``, creating the objects and lists on the way."""
    obj = copy.deepcopy(obj)
    node: Any = obj
    for here, there in itertools.pairwise(path):
        empty: Any = [] if isinstance(there, int) else {}
        if isinstance(node, list):
            if not node:
                node.append(empty)
            node = node[here]
        else:
            node = node.setdefault(here, empty)
    if isinstance(node, list):
        node[:] = [value]
    else:
        node[path[-1]] = value
    return obj


SPEC = [n for n in nodes(openapi_schema()["properties"]["spec"], ("spec",))]


def _strict(schema: Schema) -> bool:
    return "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields")


@st.composite
def invalid_objects(draw: st.DrawFn) -> tuple[str, Path_, dict[str, Any]]:
    """(what was broken, where, the object)."""
    node = draw(st.sampled_from(SPEC))
    s, base = node.schema, minimal()
    kinds = []
    typ = s.get("type")
    if typ and not s.get("x-kubernetes-int-or-string") and "anyOf" not in s:
        kinds.append("type")
    if "minimum" in s:
        kinds.append("below minimum")
    if "maximum" in s:
        kinds.append("above maximum")
    if "enum" in s:
        kinds.append("enum")
    if typ == "string" and "pattern" in s:
        kinds.append("pattern")
    if typ == "string" and s.get("minLength", 0) > 0:
        kinds.append("too short")
    if typ == "string" and "maxLength" in s:
        kinds.append("too long")
    if typ == "object" and _strict(s):
        kinds.append("unknown field")
    if [r for r in s.get("required", []) if "default" not in s["properties"].get(r, {})]:
        kinds.append("missing required")
    if not kinds:
        return draw(cel_violations())
    kind = draw(st.sampled_from(kinds))
    if kind == "type":
        wrong = [t for t in SAMPLES if t not in COMPATIBLE.get(typ, {typ})]
        value = SAMPLES[draw(st.sampled_from(wrong))]
    elif kind in ("below minimum", "above maximum"):
        bound = s["minimum" if kind == "below minimum" else "maximum"]
        step = draw(st.integers(1, 10**6)) if typ == "integer" else draw(
            st.floats(0.001, 1e6, allow_nan=False))
        value = bound - step if kind == "below minimum" else bound + step
    elif kind == "enum":
        value = draw(st.text(max_size=12).filter(lambda v: v not in s["enum"]))
    elif kind == "pattern":
        value = draw(st.text(max_size=30).filter(
            lambda v: not re.search(s["pattern"], v)))
    elif kind == "too short":
        value = draw(st.text(max_size=s["minLength"] - 1))
    elif kind == "too long":
        value = draw(st.text(min_size=s["maxLength"] + 1, max_size=s["maxLength"] + 20))
    elif kind == "unknown field":
        name = draw(st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12).filter(
            lambda k: k not in s["properties"]))
        value = {name: draw(st.sampled_from(list(SAMPLES.values())))}
    else:
        value = {}
    return kind, node.path, put(base, node.path, value)


@st.composite
def cel_violations(draw: st.DrawFn) -> tuple[str, Path_, dict[str, Any]]:
    rule = draw(st.sampled_from(["min > max", "both stores", "no store", "window < interval",
                                 "empty source"]))
    base = minimal()
    if rule == "min > max":
        role = draw(st.sampled_from(["prefill", "decode"]))
        high = draw(st.integers(1, 50))
        low = draw(st.integers(0, high - 1))
        return rule, ("spec", role), put(base, ("spec", role, "autoscaling"),
                                         {"minReplicas": high, "maxReplicas": low})
    if rule == "both stores":
        return rule, ("spec", "kvStore"), put(base, ("spec", "kvStore", "external"),
                                              {"url": "redis://redis:6379/0"})
    if rule == "no store":
        return rule, ("spec", "kvStore"), put(base, ("spec", "kvStore"), {})
    if rule == "window < interval":
        interval = draw(st.integers(2, 600))
        return rule, ("spec", "autoscaling"), put(base, ("spec", "autoscaling"), {
            "intervalSeconds": interval, "windowSeconds": draw(st.integers(1, interval - 1))})
    return rule, ("spec", "model", "source"), put(base, ("spec", "model", "source"), "")


def test_the_minimal_object_is_admitted() -> None:
    assert validate(minimal()) == []  # so every rejection below is the mutation's doing


def test_generated_invalid_specs_are_rejected() -> None:
    tried: dict[str, int] = {}

    @fuzz(1500, invalid_objects())
    def one(case: tuple[str, Path_, dict[str, Any]]) -> None:
        kind, path, obj = case
        tried[kind] = tried.get(kind, 0) + 1
        errors = validate(obj)
        assert errors, f"admitted with {kind} at {path}: {obj['spec']}"
        # The complaint names the broken field or one of its parents.
        where = ".".join(str(p) for p in path[:2])
        assert any(e.startswith(where) for e in errors), (kind, path, errors)

    one()
    report("fuzz_crd", cases=sum(tried.values()), by_kind=dict(sorted(tried.items())),
           schema_nodes=len(SPEC))
    assert sum(tried.values()) >= 1000 * SCALE
    assert len(tried) >= 10  # every kind of breakage came up
