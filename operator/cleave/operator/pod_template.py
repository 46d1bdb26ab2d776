"""Pieces of the pods every child workload runs: metadata, security, probes, volumes, budgets.

Pure functions like ``builders``, which assembles them into Deployments and StatefulSets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cleave.operator import credentials
from cleave.operator.metadata import Manifest, labels, meta
from cleave.operator.spec import POD_FIELDS, LLMServiceSpec, PodOptions

__all__ = ["Manifest", "labels", "meta"]  # re-exported: every builder names children by them
GRACE_SECONDS = 30  # a worker's drain after SIGTERM; the pod's grace period outlives it
STARTUP_PERIOD_SECONDS = 5
# The uid the images create (docker/*.Dockerfile): a uid without a passwd entry breaks
# getpass.getuser() and with it kopf and torch's cache paths.
RUNTIME_UID = 10001
# Where an external Redis's CA certificate is mounted (kvStore.external.tls).
REDIS_CA_DIR = "/etc/cleave/redis-ca"
REDIS_CA_NAME = "ca.crt"  # the file the one key of the CA's Secret or ConfigMap becomes
REDIS_CA_FILE = f"{REDIS_CA_DIR}/{REDIS_CA_NAME}"
SECURITY = {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def pod(spec: LLMServiceSpec, component: str, container: Manifest, options: PodOptions | None,
        extra_volumes: list[Manifest], init: Manifest | None = None) -> Manifest:
    template: Manifest = {
        "metadata": {"labels": labels(spec, component)},
        "spec": {
            # Workers, the router and Redis never call the Kubernetes API: no token in the pod.
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": GRACE_SECONDS + 5,
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}, *extra_volumes],
        },
    }
    # Unset is written as null, not left out: a merge patch then removes a field the spec
    # dropped (left out, the old value would stay on the pods). Kube.apply creates without them.
    template["spec"]["imagePullSecrets"] = \
        [{"name": n} for n in spec.image_pull_secrets] or None
    template["spec"]["initContainers"] = [init] if init is not None else None
    if options is not None:  # nodeSelector, affinity, ... as written
        template["spec"].update({f: options.fields.get(f) for f in POD_FIELDS})
    return template


def probes(port: int, startup_seconds: int) -> Manifest:
    return {
        "readinessProbe": {"httpGet": {"path": "/ready", "port": port},
                           "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port},
                          "periodSeconds": 10, "failureThreshold": 6},
        # Loading (and, once, converting) a model can take minutes: liveness starts only
        # after this probe passed once, within startupTimeoutSeconds.
        "startupProbe": {"httpGet": {"path": "/health", "port": port},
                         "periodSeconds": STARTUP_PERIOD_SECONDS,
                         "failureThreshold": math.ceil(startup_seconds /
                                                       STARTUP_PERIOD_SECONDS)},
    }


def volumes(spec: LLMServiceSpec, gpu: bool) -> tuple[list[Manifest], list[Manifest]]:
    """(mounts, volumes) of a worker or router container besides ``tmp``."""
    mounts: list[Manifest] = [{"name": "tmp", "mountPath": "/tmp"},
                              {"name": "cache", "mountPath": "/cache"}]
    found: list[Manifest] = [{"name": "cache", "emptyDir": {}}]
    if spec.model_claim:
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
        found.append({"name": "models", "persistentVolumeClaim": {
            "claimName": spec.model_claim, "readOnly": True}})
    ca = spec.kv_store.tls.ca
    if ca is not None:
        mounts.append({"name": "redis-ca", "mountPath": REDIS_CA_DIR, "readOnly": True})
        found.append(credentials.key_volume("redis-ca", ca, REDIS_CA_NAME))
    if gpu:  # CUDA IPC and NCCL use shared memory; a container's default /dev/shm is 64 MiB
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        found.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    return mounts, found


def quantities(resources: Mapping[str, Any]) -> Manifest:
    """Quantities as strings: YAML's ``nvidia.com/gpu: 1`` is an int, the API wants a
    quantity (and the client refuses an int)."""
    return {section: {name: str(value) for name, value in (values or {}).items()}
            for section, values in resources.items()}


def disruption_budget(spec: LLMServiceSpec, component: str, options: PodOptions,
                      owner: Manifest) -> Manifest:
    """A node drain takes at most ``maxUnavailable`` of the role's pods at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(spec, f"{spec.name}-{component}", component, owner),
            "spec": {"maxUnavailable": options.max_unavailable,
                     "selector": {"matchLabels": labels(spec, component)}}}
