"""The one module that talks to the Kubernetes API.

Create-or-patch with three rules: a child that exists and already holds everything we want
is not written at all (an idle reconcile makes zero API writes); 404 and 409 races are
tolerated (the next reconcile converges); and fields we do not own (an HPA's replicas, a
server's defaults) are never overwritten, because patches carry only what we build.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("cleave.operator")
GROUP, VERSION, PLURAL = "cleave.dev", "v1alpha1", "llmservices"
MERGE_PATCH = "application/merge-patch+json"
_APIS = {"v1": client.CoreV1Api, "apps/v1": client.AppsV1Api,
         "policy/v1": client.PolicyV1Api, "networking.k8s.io/v1": client.NetworkingV1Api}
# What the operator creates for an LLMService, so what it prunes when no longer desired. Not
# Secrets: listing them would read every Secret of the namespace, so the operator may only get
# and create them (the chart's RBAC); one it no longer needs goes with its LLMService.
CHILD_KINDS = (("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("v1", "Service"),
               ("v1", "ConfigMap"), ("policy/v1", "PodDisruptionBudget"),
               ("networking.k8s.io/v1", "NetworkPolicy"))
# Every call is bounded: the client's default waits forever on a stuck API server, which would
# freeze a reconcile thread or an autoscaler loop for good. (connect, read) seconds.
REQUEST_TIMEOUT_S = (5.0, 30.0)


def contains(actual: Any, wanted: Any) -> bool:
    """Whether ``actual`` already holds ``wanted`` (servers add defaults; those don't count)."""
    if isinstance(wanted, Mapping):
        return isinstance(actual, Mapping) and all(
            contains(actual.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(
            contains(a, w) for a, w in zip(actual, wanted, strict=True))
    return bool(actual == wanted)


# Maps written whole: a merge patch merges maps key by key, so keys the spec no longer has
# (an old nodeSelector label, a dropped affinity term) are nulled explicitly.
REPLACED_MAPS = (("spec", "template", "spec", "nodeSelector"),
                 ("spec", "template", "spec", "affinity"))


def _null_missing(old: Any, new: Any) -> Any:
    """``new``, plus a null for each key (at any depth) that only ``old`` has."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    out = {k: _null_missing(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out


def replacing_patch(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that makes ``existing`` hold ``wanted``, the REPLACED_MAPS whole."""
    patch = copy.deepcopy(dict(wanted))
    for path in REPLACED_MAPS:
        old: Any = existing
        target: Any = patch
        for key in path[:-1]:
            old = old.get(key) if isinstance(old, Mapping) else None
            target = target.get(key) if isinstance(target, dict) else None
        if isinstance(target, dict) and path[-1] in target:
            old_value = old.get(path[-1]) if isinstance(old, Mapping) else None
            target[path[-1]] = _null_missing(old_value, target[path[-1]])
    return patch


def without_nulls(value: Any) -> Any:
    """A body to create: a null means "not set" (it only matters to patches)."""
    if isinstance(value, Mapping):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _snake(kind: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()


class Kube:
    def __init__(self, api_client: client.ApiClient,
                 timeout_s: tuple[float, float] = REQUEST_TIMEOUT_S) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s
        self.writes = 0  # API writes made: an idle reconcile must leave this unchanged

    def _call(self, verb: str, obj: Mapping[str, Any], **kwargs: Any) -> Any:
        api = _APIS[obj["apiVersion"]](self.api_client)
        method = getattr(api, f"{verb}_namespaced_{_snake(obj['kind'])}")
        return method(namespace=obj["metadata"]["namespace"], _request_timeout=self.timeout_s,
                      **kwargs)

    def _write(self, call: Callable[[], Any], raced: tuple[int, ...] = (404,)) -> bool:
        """Make one API write, counted; False (nothing written) when the API answers one of
        the ``raced`` statuses: the object went, or came, meanwhile (the next reconcile
        converges)."""
        try:
            call()
        except ApiException as e:
            if e.status not in raced:
                raise
            return False
        self.writes += 1
        return True

    def get(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            found = self._call("read", obj, name=obj["metadata"]["name"],
                               _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(json.loads(found.data))

    def apply(self, obj: Mapping[str, Any], *, create_only: bool = False,
              create_as: Mapping[str, Any] | None = None) -> str:
        """Create or patch one child; returns "created", "patched" or "unchanged".
        ``create_as`` is the body to create it with when it differs from the one kept in
        line afterwards (an autoscaled Deployment starts at its minimum replicas)."""
        existing = self.get(obj)
        if existing is None:  # 409: created concurrently, the next reconcile compares
            created = self._write(lambda: self._call(
                "create", obj, body=without_nulls(create_as or obj)), (409,))
            return "created" if created else "unchanged"
        patch = replacing_patch(existing, {k: v for k, v in obj.items() if k != "status"})
        if create_only or contains(existing, patch):
            return "unchanged"
        patched = self._write(lambda: self._call(
            "patch", obj, name=obj["metadata"]["name"], body=patch,
            _content_type=MERGE_PATCH), (404, 409))
        return "patched" if patched else "unchanged"

    def scale(self, namespace: str, deployment: str, replicas: int) -> bool:
        """Set a Deployment's replicas through its Scale subresource (only that field, so
        nothing else of the Deployment can be overwritten); False if it is gone."""
        return self._write(lambda: client.AppsV1Api(
            self.api_client).patch_namespaced_deployment_scale(
                deployment, namespace, {"spec": {"replicas": replicas}},
                _content_type=MERGE_PATCH, _preload_content=False,
                _request_timeout=self.timeout_s))

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        found: Any = client.CoreV1Api(self.api_client).list_namespaced_pod(
            namespace, label_selector=_selector(selector), _preload_content=False,
            _request_timeout=self.timeout_s)
        return list(json.loads(found.data).get("items", []))

    def owned(self, namespace: str, selector: Mapping[str, str], owner_uid: str,
              ) -> list[dict[str, Any]]:
        """The children of one owner (by label, then by ownerReference) among every kind the
        operator creates, each with its apiVersion and kind set."""
        found: list[dict[str, Any]] = []
        for api_version, kind in CHILD_KINDS:
            api = _APIS[api_version](self.api_client)
            method = getattr(api, f"list_namespaced_{_snake(kind)}")
            raw = method(namespace, label_selector=_selector(selector), _preload_content=False,
                         _request_timeout=self.timeout_s)
            for item in json.loads(raw.data).get("items", []):
                refs = (item.get("metadata") or {}).get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    found.append({**item, "apiVersion": api_version, "kind": kind})
        return found

    def delete(self, obj: Mapping[str, Any]) -> bool:
        """Delete one object (its dependents follow in the background); False if gone."""
        return self._write(lambda: self._call("delete", obj, name=obj["metadata"]["name"],
                                              propagation_policy="Background"))

    def autoscaled_deployments(self, namespace: str) -> set[str]:
        """Deployments an HorizontalPodAutoscaler scales (KEDA's ScaledObjects make one):
        their replicas belong to it, and the operator must not write them back."""
        api = client.AutoscalingV2Api(self.api_client)
        raw: Any = api.list_namespaced_horizontal_pod_autoscaler(
            namespace, _preload_content=False, _request_timeout=self.timeout_s)
        targets = set()
        for hpa in json.loads(raw.data).get("items", []):
            ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
            if ref.get("kind") == "Deployment" and ref.get("name"):
                targets.add(str(ref["name"]))
        return targets

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        return self.secret_values(namespace, name).get(key)

    def secret_values(self, namespace: str, name: str) -> dict[str, str]:
        """A Secret's keys and values (none when it does not exist): one GET for all."""
        found = self.get({"apiVersion": "v1", "kind": "Secret",
                          "metadata": {"name": name, "namespace": namespace}})
        data = (found or {}).get("data") or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items() if v}

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        client.CustomObjectsApi(self.api_client).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
            _content_type=MERGE_PATCH, _request_timeout=self.timeout_s)
        self.writes += 1
