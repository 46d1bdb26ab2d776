"""Validate custom resources offline the way the apiserver does, against ``crds/llmservice.yaml``.

Three steps, as in the apiserver: apply the schema's structural defaults, check the
openAPIV3Schema (translated to JSON Schema 2020-12 and checked with ``jsonschema``), then
evaluate every ``x-kubernetes-validations`` CEL rule (with ``celpy``, from cel-python) with
``self`` bound to the object at the schema node that declares it. Unknown fields are errors,
as with kubectl's default strict field validation.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy.adapter import json_to_cel
from celpy.celtypes import BoolType
from celpy.evaluation import CELEvalError
from jsonschema import Draft202012Validator

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "llmservice.yaml"

Schema = dict[str, Any]


@cache
def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load(path.read_text())
    return crd


def openapi_schema(version: str = "v1alpha1") -> Schema:
    """The CRD's openAPIV3Schema for one version."""
    for v in load_crd()["spec"]["versions"]:
        if v["name"] == version:
            schema: Schema = v["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(version)


def walk_schema(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node with a readable path (``spec.decode.tolerations[]``, ``...{}``)."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk_schema(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk_schema(schema["additionalProperties"], f"{path}{{}}")
    if "items" in schema:
        yield from walk_schema(schema["items"], f"{path}[]")
    for keyword in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(keyword, []):
            yield from walk_schema(sub, path)


def _child_schema(schema: Schema, key: str) -> Schema | None:
    sub: Schema | None = schema.get("properties", {}).get(key)
    if sub is None and isinstance(schema.get("additionalProperties"), dict):
        sub = schema["additionalProperties"]
    return sub


def apply_defaults(obj: Any, schema: Schema | None = None) -> Any:
    """Return a copy of ``obj`` with structural defaults applied, recursing into defaults."""
    obj = copy.deepcopy(obj)
    _default_in_place(obj, openapi_schema() if schema is None else schema)
    return obj


def _default_in_place(obj: Any, schema: Schema) -> None:
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if "default" in sub and key not in obj:
                obj[key] = copy.deepcopy(sub["default"])
        for key, value in obj.items():
            child = _child_schema(schema, key)
            if child is not None:
                _default_in_place(value, child)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _default_in_place(item, schema["items"])


def to_json_schema(schema: Schema) -> Schema:
    """Translate a structural schema to JSON Schema 2020-12: drop the ``x-kubernetes-*``
    keywords, int-or-string becomes an anyOf, OpenAPI's boolean exclusiveMinimum/Maximum and
    ``nullable`` become their JSON Schema forms, and objects with properties reject unknown
    fields (unless they preserve them)."""
    out: Schema = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "exclusiveMinimum",
                                                       "exclusiveMaximum"):
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties"
                                          and isinstance(value, dict)):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if schema.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (out.get("type") == "object" and "properties" in out
            and "additionalProperties" not in out
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(to_json_schema(openapi_schema()))


def _format_path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"


def schema_errors(obj: Any) -> list[str]:
    errors = sorted(_validator().iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_format_path(e.absolute_path)}: {e.message}" for e in errors]


_CEL = celpy.Environment()


@cache
def _program(rule: str) -> celpy.Runner:
    return _CEL.program(_CEL.compile(rule))


def _cel_input(value: Any, schema: Schema | None) -> Any:
    """Plain data as the apiserver hands it to CEL: ``type: number`` fields are doubles."""
    if schema is None:
        return value
    if isinstance(value, dict):
        return {k: _cel_input(v, _child_schema(schema, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_input(v, schema.get("items")) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def evaluate_rule(rule: str, self_value: Any, schema: Schema | None = None) -> bool:
    """Evaluate one CEL rule with ``self`` bound to ``self_value``; errors count as failures."""
    try:
        result = _program(rule).evaluate({"self": json_to_cel(_cel_input(self_value, schema))})
    except CELEvalError:
        return False
    return isinstance(result, BoolType) and bool(result)


def cel_errors(obj: Any, schema: Schema | None = None, path: str = "") -> list[str]:
    """Evaluate the rules at every schema node the object reaches, returning their messages."""
    schema = openapi_schema() if schema is None else schema
    errors = [f"{path or '<root>'}: {rule.get('message') or 'failed rule: ' + rule['rule']}"
              for rule in schema.get("x-kubernetes-validations", [])
              if not evaluate_rule(rule["rule"], obj, schema)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            child = _child_schema(schema, key)
            if child is not None:
                errors += cel_errors(value, child, f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += cel_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def validate(obj: Any) -> list[str]:
    """All the apiserver's complaints about a custom resource; empty when it would be admitted."""
    defaulted = apply_defaults(obj)
    return schema_errors(defaulted) + cel_errors(defaulted)


# --- building test objects ----------------------------------------------------------------

def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "cleave.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {
            "model": {"name": "smollm2-135m-instruct", "source": "smollm2-135m-instruct"},
            "decode": {},
            "kvStore": {"managed": {}},
        },
    }


def with_spec(**changes: Any) -> dict[str, Any]:
    """``minimal()`` with spec paths set (``decode__replicas=-1``); None deletes the key."""
    obj = minimal()
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = obj["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj
