"""Builders of OpenAPI v3 schema nodes for the LLMService CRD (``crd_schema``, ``crd_status``).

Each call returns a fresh dict, so one builder can serve two places (prefill and decode) and
the result is plain data: ``yaml.safe_dump`` writes it as is. A node's ``description`` comes
first; ``""`` leaves it out, which only the items of a described list or map do (kubectl
explain shows the list's or map's description for them). Keyword arguments left at ``None``
are left out of the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Schema = dict[str, Any]

# Kubernetes' own quantity pattern (apimachinery's resource.Quantity): 2Gi, 500m, 1e3, 1.5.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
                    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _node(description: str, kind: str | None, **keywords: Any) -> Schema:
    node: Schema = {"description": description} if description else {}
    if kind is not None:
        node["type"] = kind
    node.update({k: v for k, v in keywords.items() if v is not None})
    return node


def rule(cel: str, message: str) -> Schema:
    """One ``x-kubernetes-validations`` entry: the apiserver rejects an object where ``cel``
    (with ``self`` bound to the node that declares it) is false, answering ``message``."""
    return {"rule": cel, "message": message}


def integer(description: str, *, minimum: int | None = None, maximum: int | None = None,
            default: int | None = None, bits: int = 32) -> Schema:
    return _node(description, "integer", format=f"int{bits}", minimum=minimum,
                 maximum=maximum, default=default)


def number(description: str, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None, default: float | None = None) -> Schema:
    """A JSON number; ``above`` is an exclusive minimum (``above=0``: greater than 0)."""
    if above is not None:
        assert minimum is None, "minimum or above, not both"
        return _node(description, "number", minimum=above, exclusiveMinimum=True,
                     maximum=maximum, default=default)
    return _node(description, "number", minimum=minimum, maximum=maximum, default=default)


def string(description: str, *, enum: Sequence[str] | None = None, pattern: str | None = None,
           min_length: int | None = None, default: str | None = None,
           format: str | None = None, rules: Sequence[Schema] = ()) -> Schema:
    return _node(description, "string", format=format,
                 enum=list(enum) if enum is not None else None, pattern=pattern,
                 minLength=min_length, default=default,
                 **{"x-kubernetes-validations": list(rules) or None})


def name(description: str) -> Schema:
    """A non-empty string naming something (a Secret, a claim, a model)."""
    return string(description, min_length=1)


def boolean(description: str, *, default: bool | None = None) -> Schema:
    return _node(description, "boolean", default=default)


def quantity(description: str, *, default: str | None = None) -> Schema:
    """A Kubernetes quantity: an integer, or a string such as ``2Gi`` or ``500m``."""
    return _node(description, None, **{"x-kubernetes-int-or-string": True},
                 anyOf=[{"type": "integer"}, {"type": "string"}], pattern=QUANTITY_PATTERN,
                 default=default)


def obj(description: str, properties: Mapping[str, Schema], *, required: Sequence[str] = (),
        default: Schema | None = None, rules: Sequence[Schema] = ()) -> Schema:
    """An object with these fields (unknown ones are pruned); ``rules`` are its CEL checks."""
    assert set(required) <= set(properties), f"required {required} not all properties"
    node = _node(description, "object", required=list(required) or None, default=default)
    if rules:
        node["x-kubernetes-validations"] = list(rules)
    node["properties"] = dict(properties)
    return node


def free_object(description: str) -> Schema:
    """An object kept as written (a core/v1 type such as Affinity, checked by the apiserver
    when the pod is created)."""
    return _node(description, "object", **{"x-kubernetes-preserve-unknown-fields": True})


def map_of(description: str, values: Schema) -> Schema:
    """An object with arbitrary keys, every value matching ``values``."""
    return _node(description, "object", additionalProperties=values)


def array(description: str, items: Schema, *, map_keys: Sequence[str] | None = None,
          max_items: int | None = None) -> Schema:
    """A list replaced as a whole by an apply (atomic), or merged by ``map_keys`` (a map)."""
    node = _node(description, "array", maxItems=max_items)
    if map_keys:
        node["x-kubernetes-list-type"] = "map"
        node["x-kubernetes-list-map-keys"] = list(map_keys)
    else:
        node["x-kubernetes-list-type"] = "atomic"
    node["items"] = items
    return node


def secret_ref(description: str) -> Schema:
    """A key of a Secret in the LLMService's namespace."""
    return obj(description, {
        "name": name("The Secret's name, in the LLMService's namespace."),
        "key": name("The key within the Secret whose value is used."),
    }, required=["name", "key"])


def column(title: str, kind: str, json_path: str, description: str = "") -> Schema:
    """One of ``kubectl get``'s additionalPrinterColumns."""
    col: Schema = {"name": title, "type": kind}
    if description:
        col["description"] = description
    col["jsonPath"] = json_path
    return col
