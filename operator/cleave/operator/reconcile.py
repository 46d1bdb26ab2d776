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
from cleave.operator.status import (
    RoleObservation,
    compute_status,
    observe_role,
    reconciled_part,
)


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    actions: list[tuple[str, str]]  # (created|patched, "Kind/name")
    error: str | None = None


def owned_replicas(spec: LLMServiceSpec) -> dict[str, int | None]:
    """The replicas every reconcile writes. None leaves them to their owner: an external
    autoscaler (mode External), or the Cleave autoscaler for a role with an autoscaling block
    (writing the spec's count here would undo each of its scale operations)."""
    if spec.autoscaling_mode == "External":
        return {"prefill": None, "decode": None}
    owned = spec.autoscaled_roles()
    return {"prefill": spec.prefill.replicas if spec.prefill and "prefill" not in owned
            else None,
            "decode": spec.decode.replicas if "decode" not in owned else None}


def initial_replicas(spec: LLMServiceSpec) -> dict[str, int]:
    """Replicas an autoscaled role's Deployment is created with (never written again): its
    minimum, or 1 when the minimum is 0 but scale to zero is off (the policy keeps one)."""
    initial = {}
    for name in spec.autoscaled_roles():
        role = spec.prefill if name == "prefill" else spec.decode
        assert role is not None and role.autoscaling is not None
        low = role.autoscaling.min_replicas
        initial[name] = low if low > 0 or spec.scale_to_zero else 1
    return initial


def _with_replicas(child: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    return {**child, "spec": {**child["spec"], "replicas": replicas}}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(kube: Kube, obj: Mapping[str, Any]) -> Outcome:
    meta = obj["metadata"]
    generation = int(meta.get("generation", 1))
    previous = reconciled_part(obj.get("status") or {})
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
    initial = {f"{spec.name}-{role}": n for role, n in initial_replicas(spec).items()}
    for child in builders.desired_children(spec, owner, password, owned_replicas(spec)):
        name = child["metadata"]["name"]
        first = _with_replicas(child, initial[name]) \
            if child["kind"] == "Deployment" and name in initial else None
        # The password Secret is written once: regenerating it would cut every client off.
        result = kube.apply(child, create_only=child["kind"] == "Secret", create_as=first)
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
