"""The scheduler's filter for the one node: does a pod fit here at all?

A real scheduler leaves a pod Pending with ``PodScheduled=False, reason Unschedulable`` when no
node matches its nodeSelector or has the extended resources it asks for (``nvidia.com/gpu``);
the operator's status and autoscaler read exactly that. This node has no GPUs and the labels
below, so a GPU service's pods stay Pending here as on a CPU-only cluster.
"""

from __future__ import annotations

from typing import Any

NODE_LABELS = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
ALLOCATABLE = ("cpu", "memory", "ephemeral-storage", "pods")  # not enforced: only known


def unfit(pod_spec: dict[str, Any], node_name: str) -> str:
    """Why the pod cannot be scheduled on this node, in the scheduler's words ('' if it can)."""
    labels = {**NODE_LABELS, "kubernetes.io/hostname": node_name}
    wanted = pod_spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in wanted.items()):
        return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    for container in pod_spec.get("containers") or []:
        resources = container.get("resources") or {}
        for section in ("requests", "limits"):
            for name, value in (resources.get(section) or {}).items():
                if name not in ALLOCATABLE and str(value) not in ("0", ""):
                    return f"0/1 nodes are available: 1 Insufficient {name}."
    return ""


def pending_status(reason: str) -> dict[str, Any]:
    return {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": reason}]}
