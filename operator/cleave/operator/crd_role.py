"""The worker roles' part of the LLMService CRD schema: ``spec.prefill`` and ``spec.decode``
are both :func:`role`, apart from their autoscaling targets. Part of the document
``crd_schema`` builds."""

from __future__ import annotations

from collections.abc import Mapping

from cleave.operator.crd_fields import (
    Schema,
    array,
    free_object,
    integer,
    map_of,
    number,
    obj,
    quantity,
    rule,
    string,
)


def resources() -> Schema:
    return obj(
        "core/v1 ResourceRequirements of each worker's container (nvidia.com/gpu included). A "
        "GPU (nvidia.com/gpu in limits, else requests) makes the worker run on CUDA and counts "
        "per replica against autoscaling.gpuBudget.", {
            "limits": map_of("Most of each resource one worker may use, by resource name (cpu, "
                             "memory, nvidia.com/gpu, ...), as quantities (2, 500m, 4Gi).",
                             quantity("")),
            "requests": map_of("What the scheduler reserves for one worker, by resource name, "
                               "as quantities; a resource with only a limit requests its "
                               "limit.", quantity("")),
        })


def placement(what: str) -> dict[str, Schema]:
    """Where a role's (or the router's) pods run and how they are kept: the pod-spec fields
    passed through as written (spec.POD_FIELDS), the startup timeout and the disruption
    budget. Shared by both worker roles and the router."""
    return {
        "nodeSelector": map_of(f"Node labels each {what}'s node must carry (the pod's "
                               "nodeSelector), e.g. a GPU node pool's label.", string("")),
        "tolerations": tolerations(what),
        "affinity": free_object(f"core/v1 Affinity of each {what} pod (node, pod and "
                                "anti-affinity), as in a pod spec."),
        "topologySpreadConstraints": array(
            f"core/v1 TopologySpreadConstraints of each {what} pod, as in a pod spec: e.g. "
            "spread a role's pods across zones.",
            free_object("One constraint (maxSkew, topologyKey, whenUnsatisfiable, "
                        "labelSelector).")),
        "priorityClassName": string(f"PriorityClass of each {what} pod: which pods the "
                                    "scheduler preempts first when the cluster is full."),
        "runtimeClassName": string(f"RuntimeClass of each {what} pod, e.g. nvidia where the "
                                   "GPU runtime is not the node's default."),
        "startupTimeoutSeconds": integer(
            f"Seconds a {what} may take to load (and, once, convert) its model before its "
            "pod is restarted (the startup probe's budget; liveness starts after it). Raise it "
            "for large models. Default 600.", minimum=10, default=600),
        "podDisruptionBudget": obj(
            f"The PodDisruptionBudget of the {what} pods (<name>-<role>): how many a node "
            "drain may take down at a time.", {
                "maxUnavailable": {**quantity(
                    "Most pods unavailable at once during voluntary disruptions, a count or "
                    "a percentage (25%). Default 1."), "pattern": "^[0-9]+%?$", "default": 1},
            }),
    }


def tolerations(what: str = "worker") -> Schema:
    return array(
        f"Node taints each {what} pod tolerates (core/v1 Tolerations), e.g. key nvidia.com/gpu, "
        "operator Exists, effect NoSchedule on GPU nodes.", obj("", {
            "key": string("The taint key matched; empty with operator Exists matches every "
                          "taint."),
            "operator": string("Exists matches any value of the key; Equal (the default) only "
                               "the given value.", enum=["Exists", "Equal"]),
            "value": string("The taint value matched by operator Equal; empty with Exists."),
            "effect": string("The taint effect matched: NoSchedule, PreferNoSchedule or "
                             "NoExecute; empty matches every effect.",
                             enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
            "tolerationSeconds": integer("With effect NoExecute: seconds the pod stays on a "
                                         "node after the taint appears; unset: forever.",
                                         bits=64),
        }))


def engine() -> Schema:
    return obj("The inference engine's limits in each worker of the role; an unset field takes "
               "the engine's default.", {
        "maxBatchedTokens": integer(
            "Token budget of one engine step (prompt chunks and decode tokens together): longer "
            "prompts are prefilled in chunks of at most this many tokens. Default 512.",
            minimum=1),
        "maxNumSeqs": integer("Most requests one worker runs at once (its batch). Default 64.",
                              minimum=1),
        "kvCacheMemory": quantity(
            "Bytes of the worker's KV cache pool, as a quantity (256Mi, 2Gi): it bounds the "
            "tokens of context the worker holds at once. Default: 1Gi on CPU, 80% of the free "
            "GPU memory on a GPU."),
    })


def role(role_name: str, description: str, *, tokens: str, signal: str,
         targets: Mapping[str, Schema]) -> Schema:
    """A worker role's block, the same for prefill and decode but for ``targets`` (the role's
    own autoscaling targets, named by ``signal``) and which ``tokens`` its throughput counts
    (Prompt, Output). A field added here reaches both roles."""
    autoscaling = obj(
        f"Hands the {role_name} replicas to the Cleave autoscaler (mode Cleave; Disabled "
        f"ignores this block): replica bounds, {signal} and the capacity prior. Without it the "
        "role keeps its fixed replicas.", {
            "minReplicas": integer(
                "Fewest replicas the autoscaler keeps, and the count the Deployment is created "
                "with; 0 needs autoscaling.scaleToZero. Default 1.", minimum=0, default=1),
            "maxReplicas": integer(
                "Most replicas the autoscaler scales to; at least minReplicas. Unset: "
                "minReplicas (1 if that is 0), so the role does not grow.", minimum=1),
            **targets,
            "tokensPerSecondPerReplica": number(
                f"{tokens} tokens/s one {role_name} replica sustains at saturation: the "
                "autoscaler's capacity prior (a higher measured rate replaces it), sizing the "
                "role as demand / (0.8 * this). Unset: no capacity model; the role scales on "
                "its targets and on rates measured while a queue existed.", above=0),
        }, rules=[rule("!has(self.minReplicas) || !has(self.maxReplicas) "
                       "|| self.minReplicas <= self.maxReplicas",
                       f"{role_name}.autoscaling.minReplicas must be <= maxReplicas")])
    return obj(description, {
        "replicas": integer(
            f"{role_name.capitalize()} worker pods (Deployment <name>-{role_name}), written by "
            "every reconcile unless another owner has them: the Cleave autoscaler (an "
            "autoscaling block in mode Cleave: this field is then ignored), mode External (only "
            "the count the Deployment is created with), or an HPA whose scaleTargetRef names "
            "the Deployment. Default 1.", minimum=0, default=1),
        "resources": resources(),
        **placement("worker"),
        "engine": engine(),
        "autoscaling": autoscaling,
    })


def latency_target(what: str, role_name: str) -> Schema:
    return number(
        f"Target p90 {what}, in seconds: the autoscaler adds {role_name} replicas while the "
        "p90 over windowSeconds is above it (beyond a 10% band) and may remove them while it "
        "is below. Unset: no latency target.", above=0)
