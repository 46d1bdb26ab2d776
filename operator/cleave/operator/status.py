"""The LLMService status, computed from what the cluster reports: a pure function.

Conditions follow Kubernetes conventions (Ready, Progressing, Degraded) and their reasons
tell apart the cases an operator of the service needs to tell apart: pods waiting for GPU
capacity, pods scheduled but not ready yet, an invalid spec, and all replicas ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cleave.autoscaling.pods import PodCounts
from cleave.operator.spec import LLMServiceSpec

AUTOSCALER = "autoscaler"  # status key owned by the autoscaler loop, see reconciled_part()


@dataclass(frozen=True)
class RoleObservation:
    desired: int
    ready: int
    pending_unschedulable: int = 0  # pods the scheduler cannot place
    pending_for_gpu: bool = False  # ... because no node has the GPUs they ask for
    message: str = ""


def observe_role(deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]
                 ) -> RoleObservation:
    """Summarise a role's Deployment and pods as a controller reports them."""
    if deployment is None:
        return RoleObservation(0, 0, message="deployment not created yet")
    desired = int((deployment.get("spec") or {}).get("replicas", 1))
    ready = int((deployment.get("status") or {}).get("readyReplicas", 0) or 0)
    unschedulable, gpu, message = 0, False, ""
    for pod in pods:
        if (cond := _unschedulable(pod)) is not None:
            unschedulable += 1
            text = str(cond.get("message", ""))
            gpu = gpu or "nvidia.com/gpu" in text
            message = message or text
    return RoleObservation(desired, ready, unschedulable, gpu, message)


def _unschedulable(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return cond  # type: ignore[no-any-return]
    return None


def is_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def live_pods(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods that are or will be capacity: not terminating, not finished."""
    return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]


def count_pods(replicas: int, pods: Sequence[Mapping[str, Any]]) -> PodCounts:
    """Ready / starting / pending pods of a role whose Deployment asks for ``replicas``; they
    always add up to ``replicas``, the count the autoscaler compares its decisions with.

    Pods the ReplicaSet has not created yet count as starting: just after a scale-up they do
    not exist, and reading them as absent would let the next decision undo the scale-up. Pods
    beyond ``replicas`` are a rolling update's surge (or a scale-down not yet carried out):
    counting them would make a plain "hold" ask for more replicas at every template change, so
    the surplus is taken from the starting pods first (a surge pod is new), then the pending,
    then the ready ones."""
    live = live_pods(pods)
    ready = sum(1 for p in live if is_ready(p))
    pending = sum(1 for p in live if not is_ready(p) and _unschedulable(p) is not None)
    starting = len(live) - ready - pending + max(0, replicas - len(live))
    surplus = max(0, ready + starting + pending - replicas)
    for_starting = min(surplus, starting)
    for_pending = min(surplus - for_starting, pending)
    return PodCounts(ready - (surplus - for_starting - for_pending), starting - for_starting,
                     pending - for_pending)


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int,
               previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    # lastTransitionTime moves only when the status flips: a steady state writes nothing.
    since = before["lastTransitionTime"] if before and before.get("status") == status \
        and before.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def compute_status(spec: LLMServiceSpec | None, generation: int,
                   roles: Mapping[str, RoleObservation], endpoint: str | None,
                   previous: Mapping[str, Any], now: str,
                   spec_error: str | None = None) -> dict[str, Any]:
    """The reconciled status block (all but ``autoscaler``); identical inputs give an
    identical block (no spurious writes)."""
    old = list(previous.get("conditions") or [])
    if spec is None or spec_error:
        message = spec_error or "spec is missing"
        return {**{k: v for k, v in previous.items() if k not in ("conditions", AUTOSCALER)},
                "observedGeneration": generation, "conditions": [
                    _condition("Ready", False, "SpecInvalid", message, generation, old, now),
                    _condition("Progressing", False, "SpecInvalid", message, generation, old,
                               now),
                    _condition("Degraded", True, "SpecInvalid", message, generation, old, now)]}
    all_ready = all(r.ready >= r.desired for r in roles.values()) and bool(roles)
    gpu_wait = [n for n, r in roles.items() if r.pending_for_gpu]
    unsched = [n for n, r in roles.items() if r.pending_unschedulable and not r.pending_for_gpu]
    if all_ready:
        reason, message = "AllReplicasReady", "every role has its desired replicas ready"
    elif gpu_wait:
        reason = "PodsPendingForGPU"
        message = f"{', '.join(gpu_wait)} pods wait for GPU capacity: " + \
            roles[gpu_wait[0]].message
    elif unsched:
        reason = "PodsUnschedulable"
        message = f"{', '.join(unsched)} pods cannot be scheduled: " + roles[unsched[0]].message
    else:
        waiting = [f"{n} {r.ready}/{r.desired}" for n, r in roles.items() if r.ready < r.desired]
        reason, message = "PodsNotReady", "waiting for ready replicas: " + ", ".join(waiting)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "endpoint": endpoint,
        "conditions": [
            _condition("Ready", all_ready, reason, message, generation, old, now),
            _condition("Progressing", not all_ready, reason, message, generation, old, now),
            # Degraded: something will not fix itself by waiting (pods nobody can place).
            _condition("Degraded", bool(gpu_wait or unsched), reason, message, generation,
                       old, now)],
    }
    for name, r in roles.items():
        status[name] = {"desiredReplicas": r.desired, "readyReplicas": r.ready}
    return status


def reconciled_part(status: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a status the reconcile writes: not kopf's, not the autoscaler's (written
    by its own loop; carrying an old copy of it in a patch would undo newer decisions)."""
    return {k: v for k, v in status.items() if k not in ("kopf", AUTOSCALER)}
