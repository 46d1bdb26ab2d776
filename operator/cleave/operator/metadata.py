"""Every child's metadata: the labels that select it and the owner reference that ties it to
its LLMService. The bottom layer of the builders: ``credentials``, ``pod_template`` and
``builders`` all name their objects through it."""

from __future__ import annotations

from typing import Any

from cleave.operator.spec import LLMServiceSpec

Manifest = dict[str, Any]
COMPONENT = "app.kubernetes.io/component"


def labels(spec: LLMServiceSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": spec.name,
            COMPONENT: component, "app.kubernetes.io/managed-by": "cleave-operator"}


def service_labels(spec: LLMServiceSpec) -> dict[str, str]:
    """The labels every child of the service carries, whatever its component."""
    return {k: v for k, v in labels(spec, "").items() if k != COMPONENT}


def meta(spec: LLMServiceSpec, name: str, component: str, owner: Manifest) -> Manifest:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component),
            "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}]}
