"""The ``Emulator``: kmock 0.8's KubernetesEmulator plus the fixes a kopf operator needs.

It keeps kmock's object store, discovery and HTTP server, and serves resource URLs itself (see
``kmock_support`` for the full list of semantics); ``kmock_support`` runs it for tests.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import copy
import json
import re
import secrets
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, parsing
from kmock_semantics import Fail, Obj, dig, json_patch, merge, now, selects

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
URL = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                 r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?"
                 r"(?:/(?P<sub>[^/]+))?$")
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _parse_path(path: str, _parse: Callable[[str], parsing.ParsedPath] = parsing.parse_path,
                ) -> parsing.ParsedPath:
    try:
        return _parse(path)
    except ValueError:  # kmock 0.8 crashes on /api/v1/namespaces; Emulator routes URLs itself
        return parsing.ParsedPath()


parsing.parse_path = _parse_path


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with Kubernetes semantics for every resource URL."""

    rv: int = 0
    log: list[tuple[int, kmock.resource, Obj]] = attrs.field(factory=list)  # all watch events
    custom: set[kmock.resource] = attrs.field(factory=set)  # defined by CRDs
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    closing: bool = False
    # Every request, as (method, path with query, actor): the actor is "kopf" for kopf's own
    # client (its User-Agent), else the Authorization header; tests tell callers apart by it.
    requests: list[tuple[str, str, str]] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings(action="ignore", category=DeprecationWarning):
            self.resources.load_bundled()  # built-in kinds: namespaces, deployments/scale, ...

    async def _serve_version(self, request: kmock.Request) -> Obj:
        doc = cast(Obj, await super()._serve_version(request))
        doc["groupVersion"] = doc["groupVersion"].lstrip("/")  # kmock 0.8 says "/v1" for core
        for entry in doc["resources"]:  # kmock 0.8 copies these onto subresources
            if "/" in entry["name"]:
                entry.update(shortNames=[], categories=[])
        return doc

    def live(self, res: kmock.resource | None = None) -> Iterator[tuple[Any, Obj]]:
        for key, obj in list(self.objects.items()):
            if not obj.deleted and res in (None, key[0]):
                yield key, obj.raw

    def read(self, key: Any) -> Obj:
        if key not in self.objects or self.objects[key].deleted:
            group = f".{key[0].group}" if key[0].group else ""
            raise Fail(404, "NotFound", f'{key[0].plural}{group} "{key[2]}" not found')
        return copy.deepcopy(self.objects[key].raw)

    def store(self, key: Any, obj: Obj, etype: str) -> Obj:
        if self.resources[key[0]].kind == "Secret" and obj.get("stringData"):
            # The API server folds stringData into data (base64) and never stores it: a
            # reader of data (the operator's secret_value) must see what was written.
            data = obj.setdefault("data", {})
            for k, v in obj.pop("stringData").items():
                data[k] = base64.b64encode(str(v).encode()).decode()
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if etype == "DELETED":
            self.objects[key].delete()
        elif key in self.objects:
            self.objects[key].history.append(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)
        self.log.append((self.rv, key[0], {"type": etype, "object": copy.deepcopy(obj)}))
        self.changed.set()
        self.changed = asyncio.Event()
        return obj

    def create(self, res: kmock.resource, ns: str | None, body: Obj) -> Obj:
        info, meta = self.resources[res], body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        ns = (ns or meta.get("namespace") or "default") if info.namespaced else None
        key = (res, ns, meta.get("name") or "")
        if key in self.objects and not self.objects[key].deleted:
            raise Fail(409, "AlreadyExists", f'{res.plural} "{key[2]}" already exists')
        if "status" in info.subresources:
            body.pop("status", None)
        body.setdefault("apiVersion", f"{res.group}/{res.version}".lstrip("/"))
        body.setdefault("kind", info.kind)
        meta.pop("deletionTimestamp", None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now())
        meta.update(namespace=ns) if ns else meta.pop("namespace", None)
        if res == CRDS:  # serve the CRD's resources and show them in discovery
            spec, names = body["spec"], body["spec"]["names"]
            for v in spec["versions"]:
                self.custom.add(crd := kmock.resource(spec["group"], v["name"], names["plural"]))
                self.resources[crd] = kmock.ResourceInfo(
                    kind=names["kind"], singular=names.get("singular"), verbs=VERBS, namespaced=(
                        spec["scope"] == "Namespaced"), subresources=v.get("subresources", {}),
                    shortnames=names.get("shortNames", ()), categories=names.get("categories", ()))
        stored = self.store(key, body, "ADDED")
        refs = meta.get("ownerReferences")
        if refs and not any(r.get("uid") in {o["metadata"]["uid"] for _, o in self.live()}
                            for r in refs):
            # Owned by something already gone (a reconcile racing a delete): the real
            # garbage collector removes such an object shortly after; so do we, at once.
            return self.remove(key, stored)
        return stored

    def update(self, key: Any, new: Obj, sub: str | None = None) -> Obj:
        old = self.read(key)
        if sub == "status":
            new = {**copy.deepcopy(old), "status": new.get("status")}
        elif "status" in self.resources[key[0]].subresources:
            new["status"] = old.get("status")
        new = {k: v for k, v in new.items() if v is not None}
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        if meta.get("resourceVersion", old_meta["resourceVersion"]) != old_meta["resourceVersion"]:
            raise Fail(409, "Conflict", f'the object "{key[2]}" has been modified; try again')
        for field in ("name", "namespace", "uid", "creationTimestamp", "generation",
                      "deletionTimestamp", "resourceVersion"):
            meta.pop(field, None)
            if field in old_meta:
                meta[field] = old_meta[field]
        if new == old:
            return old  # a no-op: no new resourceVersion, no event
        if any(new.get(k) != old.get(k) for k in {*new, *old} - {"metadata", "status"}):
            meta["generation"] = old_meta.get("generation", 0) + 1
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self.remove(key, new)
        return self.store(key, new, "MODIFIED")

    def drop(self, key: Any) -> Obj:
        obj = self.read(key)
        if obj["metadata"].get("deletionTimestamp"):
            return obj
        if obj["metadata"].get("finalizers"):
            obj["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
            return self.store(key, obj, "MODIFIED")
        return self.remove(key, obj)

    def remove(self, key: Any, obj: Obj) -> Obj:
        self.store(key, obj, "DELETED")
        while True:  # garbage collection: delete dependents whose owners are all gone
            uids = {o["metadata"]["uid"] for _, o in self.live()}
            doomed = [k for k, o in self.live() if (refs := o["metadata"].get("ownerReferences"))
                      and not o["metadata"].get("deletionTimestamp")
                      and not any(r.get("uid") in uids for r in refs)]
            if not doomed:
                return obj
            for k in doomed:
                if k in self.objects and not self.objects[k].deleted:  # not gone already
                    self.drop(k)

    def scale(self, obj: Obj) -> Obj:
        meta, labels = obj["metadata"], dig(obj, "spec.selector.matchLabels") or {}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {
            k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                 "creationTimestamp") if k in meta},
            "spec": {"replicas": dig(obj, "spec.replicas") or 0},
            "status": {"replicas": dig(obj, "status.replicas") or 0,
                       "selector": ",".join(f"{k}={v}" for k, v in labels.items())}}

    def matches(self, ns: str | None, params: Any, obj: Obj) -> bool:
        obj = obj.get("object", obj)  # also takes watch events
        meta = obj["metadata"]
        return ((ns is None or meta.get("namespace") == ns)
                and selects(params.get("labelSelector", ""), (meta.get("labels") or {}).get)
                and selects(params.get("fieldSelector", ""), lambda path: dig(obj, path)))

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        actor = "kopf" if headers.get("user-agent", "").startswith("kopf") \
            else headers.get("authorization", "")
        self.requests.append((request.method.value, str(request.url.path_qs), actor))
        if (m := URL.match(request.url.path)) is None:  # discovery, /version, unknown URLs
            return await apps.RawHandler._handle(self, request)
        try:
            return await self.serve(request, m)
        except Fail as e:
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": e.code, "reason": e.reason, "message": e.message}, status=e.code)

    async def serve(self, request: kmock.Request, m: re.Match[str]) -> aiohttp.web.StreamResponse:
        ns, plural, name, sub = m["ns"], m["plural"], m["name"], m["sub"]
        res = kmock.resource(m["group"] or "", m["core"] or m["version"], plural)
        if ns and res not in self.resources:  # e.g. /api/v1/namespaces/NAME/status
            ns, plural, name, sub = None, "namespaces", ns, plural
            res = kmock.resource("", "v1", "namespaces")
        if res not in self.resources:
            raise Fail(404, "NotFound", f"the server could not find the resource {plural}")
        method, params, data = request.method.value, request.params, request.data
        if name is None and method == "GET" and params.get("watch") in ("true", "1"):
            return await self.watch(request, res, ns)
        if name is None and method == "GET":
            items = [o for _, o in self.live(res) if self.matches(ns, params, o)]
            return aiohttp.web.json_response({
                "apiVersion": f"{res.group}/{res.version}".lstrip("/"),
                "kind": f"{self.resources[res].kind}List",
                "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        if name is None and method == "POST":
            return aiohttp.web.json_response(self.create(res, ns, dict(data or {})), status=201)
        if name is None or sub not in (None, "status", "scale") or (
                sub == "scale" and "scale" not in self.resources[res].subresources):
            raise Fail(405, "MethodNotAllowed", f"{method} is not supported here")
        key = (res, ns, name)
        obj, ctype = self.read(key), request.headers.get("Content-Type", "")
        view: Callable[[Obj], Obj] = self.scale if sub == "scale" else lambda o: o
        if method in ("GET", "DELETE"):
            return aiohttp.web.json_response(view(obj) if method == "GET" else self.drop(key))
        if method == "PATCH" and "json-patch" in ctype:
            data = json_patch(view(obj), data)
        elif method == "PATCH" and "merge-patch" in ctype:
            if "strategic" in ctype and res in self.custom:
                raise Fail(415, "UnsupportedMediaType", "strategic merge patch is not supported")
            data = merge(view(obj), data, "strategic" in ctype)
        elif method != "PUT":
            raise Fail(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        if sub == "scale":
            data = merge(obj, {"spec": {"replicas": dig(data, "spec.replicas")}})
        return aiohttp.web.json_response(view(self.update(key, data, sub)))

    async def watch(self, request: kmock.Request, res: kmock.resource, ns: str | None,
                    ) -> aiohttp.web.StreamResponse:
        params, since, raw_request = request.params, request.params.get("resourceVersion", ""), \
            request._raw_request
        deadline = time.monotonic() + float(params.get("timeoutSeconds") or 3600)
        raw = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert raw_request is not None
        await raw.prepare(raw_request)
        events: list[Obj] = []
        initial = params.get("sendInitialEvents") == "true"  # a WatchList (kubectl >= 1.35)
        if since in ("", "0") or initial:  # the current state as ADDED events, then live
            events = [{"type": "ADDED", "object": o} for _, o in self.live(res)
                      if self.matches(ns, params, o)]
            pos = len(self.log)
            if initial:  # the bookmark that ends the initial events
                info = self.resources[res]
                group = f"{res.group}/" if res.group else ""
                events.append({"type": "BOOKMARK", "object": {
                    "kind": info.kind, "apiVersion": f"{group}{res.version}", "metadata": {
                        "resourceVersion": str(self.rv),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}})
        else:
            pos = bisect.bisect_right(self.log, int(since), key=lambda entry: entry[0])
        with contextlib.suppress(ConnectionError, RuntimeError):  # the client went away
            while not self.closing and time.monotonic() < deadline:
                changed, pos, fresh = self.changed, len(self.log), self.log[pos:]
                events += [e for _, r, e in fresh if r == res and self.matches(ns, params, e)]
                for event in events:
                    await raw.write(json.dumps(event).encode() + b"\n")
                events = []
                if raw_request.transport is None or raw_request.transport.is_closing():
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.5)
            await raw.write_eof()
        return raw
