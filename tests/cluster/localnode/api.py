"""A minimal synchronous client of the API server (the emulator's URL), with plain urllib.

The node talks to the API over HTTP like a kubelet and controller manager would, rather than
reaching into the emulator: lists of all namespaces each tick (no watches: the node polls),
create, delete, merge patches and status writes. 404 and 409 come back as :class:`ApiError`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

Obj = dict[str, Any]
PATHS = {"pods": "api/v1", "services": "api/v1", "secrets": "api/v1", "configmaps": "api/v1",
         "serviceaccounts": "api/v1", "persistentvolumeclaims": "api/v1",
         "deployments": "apis/apps/v1", "statefulsets": "apis/apps/v1"}


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Api:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        # No proxy from the environment: the API server is local.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _path(self, resource: str, namespace: str | None, name: str | None = None,
              sub: str | None = None) -> str:
        parts = [self.url, PATHS[resource]]
        parts += ["namespaces", namespace] if namespace else []
        parts += [resource] + ([name] if name else []) + ([sub] if sub else [])
        return "/".join(parts)

    def _call(self, method: str, path: str, body: Obj | None = None,
              ctype: str = "application/json") -> Obj:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(path, data=data, method=method,
                                         headers={"Content-Type": ctype})
        try:
            with self._opener.open(request, timeout=30) as response:
                result: Obj = json.loads(response.read())
                return result
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read().decode(errors="replace")) from None

    def list(self, resource: str, namespace: str | None = None) -> list[Obj]:
        items: list[Obj] = self._call("GET", self._path(resource, namespace))["items"]
        return items

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        try:
            return self._call("GET", self._path(resource, namespace, name))
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    def create(self, resource: str, namespace: str, body: Obj) -> Obj:
        return self._call("POST", self._path(resource, namespace), body)

    def delete(self, resource: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self._path(resource, namespace, name))
        except ApiError as e:
            if e.code != 404:
                raise

    def patch(self, resource: str, namespace: str, name: str, patch: Obj,
              sub: str | None = None) -> Obj | None:
        """A merge patch (of ``sub``, e.g. ``status``); None if the object is gone."""
        try:
            return self._call("PATCH", self._path(resource, namespace, name, sub), patch,
                              "application/merge-patch+json")
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    def put_status(self, resource: str, obj: Obj, status: Obj) -> Obj | None:
        """Replace the whole status (a merge patch could not drop stale fields)."""
        meta = obj["metadata"]
        body = {**obj, "metadata": {k: v for k, v in meta.items() if k != "resourceVersion"},
                "status": status}
        try:
            return self._call("PUT", self._path(resource, meta.get("namespace"), meta["name"],
                                                "status"), body)
        except ApiError as e:
            if e.code == 404:
                return None
            raise
