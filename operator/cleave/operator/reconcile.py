"""One level-based reconcile of one LLMService: desired children in, status out.

Called on create, update, resume and by a timer; it never assumes what happened before, it
compares what should exist with what does. Thin on purpose: decisions live in the pure
builders (``builders``), status rules in ``status``, API access in ``kube``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cleave.operator import builders, credentials, redis_users, security
from cleave.operator.kube import Kube
from cleave.operator.metadata import service_labels
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


def owned_replicas(spec: LLMServiceSpec, hpa_targets: Set[str] = frozenset(),
                   ) -> dict[str, int | None]:
    """The replicas every reconcile writes, per prefill, decode and router. None leaves them
    to their owner: an external autoscaler (mode External, for the worker roles), the Cleave
    autoscaler for a role with an autoscaling block (writing the spec's count here would undo
    each of its scale operations), or an HPA (or KEDA's) whose scaleTargetRef names the
    Deployment: creating one is how a user hands any Deployment's replicas over."""
    owned = spec.autoscaled_roles()
    external = spec.autoscaling_mode == "External"
    counts: dict[str, int | None] = {
        "prefill": spec.prefill.replicas if spec.prefill else None,
        "decode": spec.decode.replicas, "router": spec.router.replicas}
    for role in counts:
        if role in owned or f"{spec.name}-{role}" in hpa_targets \
                or (external and role != "router"):
            counts[role] = None
    return counts


def initial_replicas(spec: LLMServiceSpec) -> dict[str, int]:
    """Replicas each Deployment is created with (for one whose replicas are not ours, never
    written again): an autoscaled role's minimum, or 1 when the minimum is 0 but scale to zero
    is off (the policy keeps one); the spec's count otherwise."""
    initial = {"decode": spec.decode.replicas, "router": spec.router.replicas}
    if spec.prefill is not None:
        initial["prefill"] = spec.prefill.replicas
    for name in spec.autoscaled_roles():
        role = spec.prefill if name == "prefill" else spec.decode
        assert role is not None and role.autoscaling is not None
        low = role.autoscaling.min_replicas
        initial[name] = low if low > 0 or spec.scale_to_zero else 1
    return initial


def _with_replicas(child: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    return {**child, "spec": {**child["spec"], "replicas": replicas}}


def _prune(kube: Kube, spec: LLMServiceSpec, uid: str, desired: list[dict[str, Any]],
           ) -> list[tuple[str, str]]:
    """Delete the children no longer desired: a removed role, the managed Redis after a switch
    to an external one. Never a Secret: the operator may not list them (kube.CHILD_KINDS), and
    a generated one the spec no longer needs goes with its LLMService."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
    pruned = []
    for child in kube.owned(spec.namespace, service_labels(spec), uid):
        key = (child["kind"], child["metadata"]["name"])
        if key not in wanted and kube.delete(child):
            pruned.append(("deleted", f"{key[0]}/{key[1]}"))
    return pruned


def _access() -> security.Access:
    """Who the NetworkPolicies let in besides the service's pods: the operator's namespace
    (the chart's downward API) and the chart's Prometheus peers (JSON, networkPolicy values)."""
    peers = json.loads(os.environ.get("CLEAVE_METRICS_PEERS") or "[]")
    return security.Access(os.environ.get("POD_NAMESPACE") or None,
                           tuple(p for p in peers if isinstance(p, dict)))


def _kept(kube: Kube, spec: LLMServiceSpec, secret: credentials.Generated,
          fresh: Callable[[], str]) -> dict[str, str]:
    """A generated Secret's values: those it holds, else fresh ones (it is written once, so
    these are read once per reconcile and never change)."""
    found = kube.secret_values(spec.namespace, secret.name(spec))
    return {key: found.get(key) or fresh() for key in secret.keys}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(kube: Kube, obj: Mapping[str, Any]) -> Outcome:
    meta = obj["metadata"]
    generation = int(meta.get("generation", 1))
    previous = reconciled_part(obj.get("status") or {})
    try:
        # The chart sets the runtime images (CPU, and CUDA for GPU workers) the cluster's
        # services default to.
        spec = parse_spec(obj, os.environ.get("CLEAVE_RUNTIME_IMAGE") or DEFAULT_IMAGE,
                          os.environ.get("CLEAVE_RUNTIME_GPU_IMAGE", ""))
    except SpecError as e:
        status = compute_status(None, generation, {}, None, previous, _now(), spec_error=str(e))
        return Outcome(status, [], str(e))
    owner = builders.owner_reference(obj)
    passwords = redis_users.NO_PASSWORDS
    if spec.kv_store.managed:
        passwords = redis_users.RedisPasswords(**_kept(
            kube, spec, credentials.REDIS_USERS, lambda: secrets.token_urlsafe(24)))
    salt = ""
    if spec.kv_store.salt_secret is None:
        [salt] = _kept(kube, spec, credentials.KV_SALT, lambda: secrets.token_hex(16)).values()
    [token] = _kept(kube, spec, credentials.INTERNAL_TOKEN,
                    lambda: secrets.token_urlsafe(32)).values()
    actions = []
    initial = {f"{spec.name}-{role}": n for role, n in initial_replicas(spec).items()}
    replicas = owned_replicas(spec, kube.autoscaled_deployments(spec.namespace))
    desired = builders.desired_children(spec, owner, passwords, replicas, salt,
                                        internal_token=token, access=_access())
    for child in desired:
        name = child["metadata"]["name"]
        first = _with_replicas(child, initial[name]) \
            if child["kind"] == "Deployment" and name in initial else None
        # Secrets are written once: a new password or salt would cut every client off.
        result = kube.apply(child, create_only=child["kind"] == "Secret", create_as=first)
        if result != "unchanged":
            actions.append((result, f"{child['kind']}/{child['metadata']['name']}"))
    actions += _prune(kube, spec, str(meta["uid"]), desired)
    roles: dict[str, RoleObservation] = {}
    for role in (["prefill"] if spec.prefill else []) + ["decode", "router"]:
        name = f"{spec.name}-{role}"
        deployment = kube.get({"apiVersion": "apps/v1", "kind": "Deployment",
                               "metadata": {"name": name, "namespace": spec.namespace}})
        pods = kube.pods(spec.namespace, builders.labels(spec, role))
        roles[role] = observe_role(deployment, pods)
    status = compute_status(spec, generation, roles, builders.endpoint(spec), previous, _now())
    return Outcome(status, actions)
