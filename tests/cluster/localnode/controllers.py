"""The Deployment and StatefulSet controllers: Pod objects from pod templates, and statuses.

Simplified from kube-controller-manager: a Deployment owns its Pods directly (no
ReplicaSets), named ``<deploy>-<template hash>-<5 chars>`` with the ``pod-template-hash``
label. RollingUpdate surges all new pods at once and deletes old ones as new ones become
ready (maxSurge 100 %, maxUnavailable 0); Recreate deletes the old ones and waits until their
processes are gone. A StatefulSet runs ``<name>-0..N-1`` with hostname/subdomain set, one at a
time in order (OrderedReady) or all at once (Parallel), scales down from the highest ordinal,
rolls (RollingUpdate) from the highest ordinal once all are ready, and creates the
PersistentVolumeClaims of its ``volumeClaimTemplates`` (kept after it goes, as by default).
A pod name still held by a terminating pod is not reused until its processes are gone.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from .api import Api, ApiError

Obj = dict[str, Any]
ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apimachinery alphabet for generated names


@dataclass(frozen=True)
class Terminating:
    """A pod whose object is gone but whose processes are still being stopped."""

    namespace: str
    name: str
    owner: str  # owner uid ("" if none)
    labels: dict[str, str]


def template_hash(template: Obj) -> str:
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(ALPHABET[b % len(ALPHABET)] for b in digest[:10])


def is_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _victims(pods: list[Obj]) -> list[Obj]:
    """Deletion order, as the ReplicaSet controller's: not ready first, then newest first."""
    newest = sorted(pods, key=lambda p: (p["metadata"]["creationTimestamp"],
                                         p["metadata"]["name"]), reverse=True)
    return sorted(newest, key=is_ready)


def owner_of(obj: Obj) -> str:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r["uid"] for r in refs if r.get("controller")), "")


class Controllers:
    def __init__(self, api: Api, node_name: str) -> None:
        self.api, self.node_name = api, node_name

    def reconcile(self, deployments: list[Obj], statefulsets: list[Obj], pods: list[Obj],
                  terminating: list[Terminating]) -> None:
        by_owner: dict[str, list[Obj]] = {}
        for pod in pods:
            by_owner.setdefault(owner_of(pod), []).append(pod)
        for kind, objs in (("Deployment", deployments), ("StatefulSet", statefulsets)):
            for obj in objs:
                uid = obj["metadata"]["uid"]
                going = [t for t in terminating if t.owner == uid]
                try:
                    if kind == "Deployment":
                        self._deployment(obj, by_owner.get(uid, []), going)
                    else:
                        self._statefulset(obj, by_owner.get(uid, []), going)
                except ApiError as e:
                    if e.code not in (404, 409):  # raced with a delete or another writer
                        raise

    def _pod(self, owner: Obj, kind: str, name: str, labels: dict[str, str], **spec: Any,
             ) -> Obj:
        meta, template = owner["metadata"], copy.deepcopy(owner["spec"]["template"])
        pod_spec = template["spec"]
        pod_spec.update(**spec)  # unbound: the node's scheduler part filters, then binds
        pod_spec.setdefault("restartPolicy", "Always")
        pod_spec.setdefault("terminationGracePeriodSeconds", 30)
        pod_spec.setdefault("serviceAccountName", "default")
        body = {"apiVersion": "v1", "kind": "Pod", "spec": pod_spec, "metadata": {
            "name": name, "namespace": meta["namespace"],
            "labels": {**(template.get("metadata") or {}).get("labels", {}), **labels},
            "annotations": (template.get("metadata") or {}).get("annotations") or {},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind, "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}]}}
        return self.api.create("pods", meta["namespace"], body)

    def _delete(self, pod: Obj) -> None:
        self.api.delete("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])

    def _status(self, resource: str, obj: Obj, status: Obj) -> None:
        if {**(obj.get("status") or {}), **status} != obj.get("status"):
            self.api.put_status(resource, obj, {**(obj.get("status") or {}), **status})

    def _deployment(self, dep: Obj, mine: list[Obj], going: list[Terminating]) -> None:
        spec, meta = dep["spec"], dep["metadata"]
        replicas = 1 if spec.get("replicas") is None else int(spec["replicas"])
        current = template_hash(spec["template"])
        new = [p for p in mine if p["metadata"]["labels"].get("pod-template-hash") == current]
        old = [p for p in mine if p not in new]
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        if recreate:
            for pod in old:
                self._delete(pod)
            old = []
        # Recreate: no new pod until the old ones' processes are gone.
        if not (recreate and any(t.labels.get("pod-template-hash") != current for t in going)):
            for _ in range(replicas - len(new)):
                suffix = "".join(secrets.choice(ALPHABET) for _ in range(5))
                name = f"{meta['name']}-{current}-{suffix}"
                new.append(self._pod(dep, "Deployment", name, {"pod-template-hash": current}))
        for pod in _victims(new)[:max(0, len(new) - replicas)]:
            new.remove(pod)
            self._delete(pod)
        keep_old = max(0, replicas - sum(map(is_ready, new)))
        for pod in _victims(old)[:max(0, len(old) - keep_old)]:
            old.remove(pod)
            self._delete(pod)
        mine = new + old
        ready = sum(map(is_ready, mine))
        complete = ready >= replicas and len(new) == replicas == len(mine)
        self._status("deployments", dep, {
            "observedGeneration": meta.get("generation", 1), "replicas": len(mine),
            "updatedReplicas": len(new), "readyReplicas": ready, "availableReplicas": ready,
            "unavailableReplicas": max(0, replicas - ready), "conditions": [
                {"type": "Available", "status": "True" if ready >= replicas else "False",
                 "reason": "MinimumReplicasAvailable" if ready >= replicas
                 else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"
                 if complete else "ReplicaSetUpdated"}]})

    def _statefulset(self, sts: Obj, mine: list[Obj], going: list[Terminating]) -> None:
        spec, meta = sts["spec"], sts["metadata"]
        name = meta["name"]
        replicas = 1 if spec.get("replicas") is None else int(spec["replicas"])
        revision = f"{name}-{template_hash(spec['template'])}"
        ordered = (spec.get("podManagementPolicy") or "OrderedReady") == "OrderedReady"
        by_name = {p["metadata"]["name"]: p for p in mine}
        busy = {t.name for t in going}
        extra = sorted((p for p in mine if p["metadata"]["name"].rsplit("-", 1)[-1]
                        not in {str(i) for i in range(replicas)}),
                       key=lambda p: int(p["metadata"]["name"].rsplit("-", 1)[-1]), reverse=True)
        for pod in extra[:1] if ordered else extra:  # scale down from the highest ordinal
            if not (ordered and busy):
                self._delete(pod)
                by_name.pop(pod["metadata"]["name"])
        for i in range(replicas):
            pod_name = f"{name}-{i}"
            if pod_name in by_name:
                continue
            if pod_name in busy or (ordered and not all(
                    is_ready(by_name[f"{name}-{j}"]) for j in range(i))):
                if ordered:
                    break
                continue
            self._claims(sts, i)
            labels = {"controller-revision-hash": revision, "apps.kubernetes.io/pod-index":
                      str(i), "statefulset.kubernetes.io/pod-name": pod_name}
            by_name[pod_name] = self._pod(sts, "StatefulSet", pod_name, labels,
                                          hostname=pod_name, subdomain=spec.get("serviceName"),
                                          volumes=self._volumes(sts, i))
            if ordered:
                break
        pods = list(by_name.values())
        outdated = [p for p in pods if p["metadata"]["labels"].get("controller-revision-hash")
                    != revision]
        rolling = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate") == "RollingUpdate"
        if rolling and outdated and not busy and len(pods) == replicas and all(map(is_ready, pods)):
            self._delete(max(outdated, key=lambda p: p["metadata"]["name"]))
        ready, updated = sum(map(is_ready, pods)), len(pods) - len(outdated)
        self._status("statefulsets", sts, {
            "observedGeneration": meta.get("generation", 1), "replicas": len(pods),
            "readyReplicas": ready, "availableReplicas": ready, "currentReplicas": updated,
            "updatedReplicas": updated, "updateRevision": revision, "currentRevision": revision
            if updated == len(pods) else (sts.get("status") or {}).get("currentRevision", ""),
            "collisionCount": 0})

    def _volumes(self, sts: Obj, i: int) -> list[Obj]:
        volumes = list(sts["spec"]["template"]["spec"].get("volumes") or [])
        for tpl in sts["spec"].get("volumeClaimTemplates") or []:
            claim = f"{tpl['metadata']['name']}-{sts['metadata']['name']}-{i}"
            volumes.append({"name": tpl["metadata"]["name"],
                            "persistentVolumeClaim": {"claimName": claim}})
        return volumes

    def _claims(self, sts: Obj, i: int) -> None:
        ns = sts["metadata"]["namespace"]
        for tpl in sts["spec"].get("volumeClaimTemplates") or []:
            claim = f"{tpl['metadata']['name']}-{sts['metadata']['name']}-{i}"
            if self.api.get("persistentvolumeclaims", ns, claim) is None:
                self.api.create("persistentvolumeclaims", ns, {
                    "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": claim, "namespace": ns, "labels": (
                        sts["spec"].get("selector") or {}).get("matchLabels") or {}},
                    "spec": tpl.get("spec") or {}})
