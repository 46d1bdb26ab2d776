"""The one module that talks to the Kubernetes API.

Create-or-patch with three rules: a child that exists and already holds everything we want
is not written at all (an idle reconcile makes zero API writes); 404 and 409 races are
tolerated (the next reconcile converges); and fields we do not own (an HPA's replicas, a
server's defaults) are never overwritten, because patches carry only what we build.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("cleave.operator")
GROUP, VERSION, PLURAL = "cleave.dev", "v1alpha1", "llmservices"
MERGE_PATCH = "application/merge-patch+json"
_APIS = {"v1": client.CoreV1Api, "apps/v1": client.AppsV1Api}
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
        if existing is None:
            try:
                self._call("create", obj, body=create_as or obj)
            except ApiException as e:
                if e.status != 409:
                    raise
                return "unchanged"  # created concurrently: the next reconcile compares
            self.writes += 1
            return "created"
        if create_only or contains(existing, {k: v for k, v in obj.items() if k != "status"}):
            return "unchanged"
        try:
            self._call("patch", obj, name=obj["metadata"]["name"], body=obj,
                       _content_type=MERGE_PATCH)
        except ApiException as e:
            if e.status not in (404, 409):
                raise
            return "unchanged"
        self.writes += 1
        return "patched"

    def scale(self, namespace: str, deployment: str, replicas: int) -> bool:
        """Set a Deployment's replicas through its Scale subresource (only that field, so
        nothing else of the Deployment can be overwritten); False if it is gone."""
        try:
            client.AppsV1Api(self.api_client).patch_namespaced_deployment_scale(
                deployment, namespace, {"spec": {"replicas": replicas}},
                _content_type=MERGE_PATCH, _preload_content=False,
                _request_timeout=self.timeout_s)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        self.writes += 1
        return True

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        found: Any = client.CoreV1Api(self.api_client).list_namespaced_pod(
            namespace, label_selector=label_selector, _preload_content=False,
            _request_timeout=self.timeout_s)
        return list(json.loads(found.data).get("items", []))

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        found = self.get({"apiVersion": "v1", "kind": "Secret",
                          "metadata": {"name": name, "namespace": namespace}})
        if found is None:
            return None
        value = (found.get("data") or {}).get(key)
        return base64.b64decode(value).decode() if value else None

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        client.CustomObjectsApi(self.api_client).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
            _content_type=MERGE_PATCH, _request_timeout=self.timeout_s)
        self.writes += 1
