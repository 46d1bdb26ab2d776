"""One level-based reconcile of one LLMService: desired children in, status out.

Called on create, update, resume and by a timer; it never assumes what happened before, it
compares what should exist with what does. Thin on purpose: decisions live in the pure
builders (``builders``), status rules in ``status``, API access in ``kube``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cleave.operator import builders
from cleave.operator.kube import Kube
from cleave.operator.spec import DEFAULT_IMAGE, LLMServiceSpec, SpecError, parse_spec
from cleave.operator.status import RoleObservation, compute_status, observe_role


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    actions: list[tuple[str, str]]  # (created|patched, "Kind/name")
    error: str | None = None


def owned_replicas(spec: LLMServiceSpec) -> dict[str, int | None]:
    """The replicas the operator writes; with an external autoscaler, none."""
    if spec.autoscaling_mode == "External":
        return {"prefill": None, "decode": None}
    return {"prefill": spec.prefill.replicas if spec.prefill else None,
            "decode": spec.decode.replicas}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(kube: Kube, obj: Mapping[str, Any]) -> Outcome:
    meta = obj["metadata"]
    generation = int(meta.get("generation", 1))
    previous = dict(obj.get("status") or {})
    previous.pop("kopf", None)
    try:
        # The chart sets the runtime image the cluster's services default to.
        spec = parse_spec(obj, os.environ.get("CLEAVE_RUNTIME_IMAGE", DEFAULT_IMAGE))
    except SpecError as e:
        status = compute_status(None, generation, {}, None, previous, _now(), spec_error=str(e))
        return Outcome(status, [], str(e))
    owner = builders.owner_reference(obj)
    password = ""
    if spec.kv_store.managed:
        password = kube.secret_value(spec.namespace, f"{spec.name}-redis-auth", "password") \
            or secrets.token_urlsafe(24)
    actions = []
    for child in builders.desired_children(spec, owner, password, owned_replicas(spec)):
        # The password Secret is written once: regenerating it would cut every client off.
        result = kube.apply(child, create_only=child["kind"] == "Secret")
        if result != "unchanged":
            actions.append((result, f"{child['kind']}/{child['metadata']['name']}"))
    roles: dict[str, RoleObservation] = {}
    for role in (["prefill"] if spec.prefill else []) + ["decode", "router"]:
        name = f"{spec.name}-{role}"
        deployment = kube.get({"apiVersion": "apps/v1", "kind": "Deployment",
                               "metadata": {"name": name, "namespace": spec.namespace}})
        pods = kube.pods(spec.namespace, builders.labels(spec, role))
        roles[role] = observe_role(deployment, pods)
    status = compute_status(spec, generation, roles, builders.endpoint(spec), previous, _now())
    return Outcome(status, actions)
