"""The LLMService CRD's ``status`` schema: what the reconcile (status.py) and the Cleave
autoscaler write. Part of the document ``crd_schema`` builds."""

from __future__ import annotations

from cleave.operator.crd_fields import Schema, array, boolean, integer, map_of, obj, string

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


def replica_status(component: str) -> Schema:
    """The replicas of one Deployment (``<name>-<component>``) as the reconcile last saw it."""
    return obj(f"The {component} Deployment <name>-{component}, as last observed.", {
        "desiredReplicas": integer(f"Replicas the {component} Deployment asks for (its "
                                   "spec.replicas), whoever set them."),
        "readyReplicas": integer(f"{component.capitalize()} pods that passed their readiness "
                                 "probe (the Deployment's status.readyReplicas)."),
    })


def _conditions() -> Schema:
    return array(
        "Kubernetes-style conditions, one per type: Ready (every role has its desired replicas "
        "ready), Progressing (replicas are still starting) and Degraded (something waiting "
        "will not fix: pods no node can take, or a spec the operator cannot honour).",
        obj("", {
            "type": string("Ready, Progressing or Degraded.", enum=CONDITION_TYPES),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string(
                "Why, in one CamelCase word: AllReplicasReady, PodsNotReady, "
                "PodsPendingForGPU (no node has the GPUs the pods ask for), PodsUnschedulable "
                "or SpecInvalid."),
            "message": string("The reason for humans: which roles wait and on what, or what "
                              "is wrong with the spec."),
            "lastTransitionTime": string("When status last changed (RFC 3339); a steady "
                                         "condition keeps its time.", format="date-time"),
            "observedGeneration": integer("The metadata.generation this condition was "
                                          "computed from.", bits=64),
        }, required=["type", "status"]), map_keys=["type"])


def _decision() -> Schema:
    return obj("", {
        "time": string("When the decision was made (RFC 3339).", format="date-time"),
        "role": string("The role it scales: prefill or decode.", enum=["prefill", "decode"]),
        "current": integer("The role's replicas when the decision was made."),
        "desired": integer("The replicas the autoscaler decided on."),
        "reason": string("The policy's reason, e.g. 'ttft asks for 2; up to 2 (window 2, "
                         "step 4)': the signal that asked and the stabilization applied."),
        "advisory": boolean("Recorded in dry-run mode, not acted on."),
        "inputs": map_of(
            "The policy's inputs (signals, targets, replica counts) as strings: latency_p90, "
            "latency_target, kv_usage, kv_watermark, queue_depth, token_rate, "
            "throughput_per_replica, ready, starting, pending, min, max ('none': missing or "
            "stale).", string("")),
    }, required=["time", "role", "current", "desired", "reason"])


def _autoscaler() -> Schema:
    return obj(
        "What the Cleave autoscaler wants and why (written only when a decision changes "
        "something; absent until the first one).", {
            "dryRun": boolean("The decisions below are advisory; the Deployments were left "
                              "alone."),
            "desiredReplicas": obj("The autoscaler's desired replicas of each role it owns.", {
                "prefill": integer("Desired prefill replicas; absent when the autoscaler does "
                                   "not own the prefill role."),
                "decode": integer("Desired decode replicas; absent when the autoscaler does "
                                  "not own the decode role."),
            }),
            "decisions": array(
                "The last 10 decisions that changed a role's desired replicas, newest first, "
                "with the metric values behind them.", _decision(), max_items=10),
        })


def status() -> Schema:
    return obj("What the operator observed; written by the operator, never by users.", {
        "observedGeneration": integer("The metadata.generation the reconcile last acted on: "
                                      "below metadata.generation, the latest spec is not "
                                      "applied yet.", bits=64),
        "endpoint": string("The OpenAI-compatible base URL of the router inside the cluster: "
                           "http://<name>-router.<namespace>.svc:<router.port>/v1."),
        "prefill": replica_status("prefill"),
        "decode": replica_status("decode"),
        "router": replica_status("router"),
        "conditions": _conditions(),
        "autoscaler": _autoscaler(),
    })
