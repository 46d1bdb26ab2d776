"""Status conditions from observed Deployments and pods."""

from __future__ import annotations

from typing import Any

from cleave.operator.spec import parse_spec
from cleave.operator.status import RoleObservation, compute_status, observe_role

SPEC = parse_spec({"metadata": {"name": "chat", "namespace": "ml"}, "spec": {
    "model": {"name": "m", "source": "m"}, "decode": {}, "kvStore": {"managed": {}}}})
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def dep(replicas: int, ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def unschedulable(message: str) -> dict[str, Any]:
    return {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": message}]}}


def test_all_ready() -> None:
    roles = {"decode": observe_role(dep(2, 2), []), "router": observe_role(dep(1, 1), [])}
    status = compute_status(SPEC, 3, roles, "http://e", {}, T0)
    assert conditions(status) == {"Ready": ("True", "AllReplicasReady"),
                                  "Progressing": ("False", "AllReplicasReady"),
                                  "Degraded": ("False", "AllReplicasReady")}
    assert status["observedGeneration"] == 3
    assert status["decode"] == {"desiredReplicas": 2, "readyReplicas": 2}
    assert status["endpoint"] == "http://e"


def test_pending_for_gpu_is_told_apart_from_not_ready() -> None:
    gpu = observe_role(dep(2, 0), [unschedulable(
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")])
    assert gpu.pending_for_gpu and gpu.pending_unschedulable == 1
    status = compute_status(SPEC, 1, {"decode": gpu, "router": observe_role(dep(1, 1), [])},
                            None, {}, T0)
    assert conditions(status)["Ready"] == ("False", "PodsPendingForGPU")
    assert conditions(status)["Degraded"] == ("True", "PodsPendingForGPU")
    assert "Insufficient nvidia.com/gpu" in status["conditions"][0]["message"]
    starting = observe_role(dep(2, 1), [{"status": {"phase": "Running"}}])
    status = compute_status(SPEC, 1, {"decode": starting}, None, {}, T0)
    assert conditions(status) == {"Ready": ("False", "PodsNotReady"),
                                  "Progressing": ("True", "PodsNotReady"),
                                  "Degraded": ("False", "PodsNotReady")}
    assert "decode 1/2" in status["conditions"][0]["message"]


def test_other_unschedulable_pods_are_degraded_but_not_gpu() -> None:
    cpu = observe_role(dep(1, 0), [unschedulable("0/3 nodes are available: Insufficient cpu")])
    status = compute_status(SPEC, 1, {"decode": cpu}, None, {}, T0)
    assert conditions(status)["Degraded"] == ("True", "PodsUnschedulable")


def test_invalid_spec_is_degraded_not_a_crash() -> None:
    status = compute_status(None, 4, {}, None, {}, T0, spec_error="minReplicas 4 > max 2")
    assert conditions(status)["Degraded"] == ("True", "SpecInvalid")
    assert status["observedGeneration"] == 4


def test_transition_time_moves_only_when_status_flips() -> None:
    ready = {"decode": observe_role(dep(1, 1), [])}
    first = compute_status(SPEC, 1, ready, None, {}, T0)
    again = compute_status(SPEC, 1, ready, None, first, T1)
    assert again == first  # nothing changed: nothing to write
    lost = compute_status(SPEC, 1, {"decode": observe_role(dep(1, 0), [])}, None, again, T1)
    assert lost["conditions"][0]["lastTransitionTime"] == T1


def test_missing_deployment_counts_as_not_ready() -> None:
    missing = observe_role(None, [])
    assert missing == RoleObservation(0, 0, message="deployment not created yet")
