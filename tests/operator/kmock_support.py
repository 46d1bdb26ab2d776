"""A Kubernetes API emulator for operator tests: kmock 0.8 plus the fixes a kopf operator needs.

``Emulator`` keeps kmock's object store, discovery and HTTP server, and serves resource URLs
itself: uid/resourceVersion/generation/creationTimestamp, 201 on create, errors as ``Status``,
PUT, merge/strategic-merge/JSON patches, ``status`` and ``scale`` subresources, label and field
selectors, watches resumed from a resourceVersion, finalizers, CRDs added to discovery when
created, and garbage collection of dependents whose owners are all gone (after each removal).
``kube_emulator()`` serves it on a free 127.0.0.1 port from a thread with its own event loop, so
sync clients (``kubernetes``, ``kubectl``) and kopf (``run_operator()``) can all use it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import datetime
import importlib
import json
import re
import secrets
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import aiohttp.web
import attrs
import kmock
import kopf
import kubernetes.client
import yaml
from kmock._internal import apps, parsing

Obj = dict[str, Any]
T = TypeVar("T")
CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "llmservice.yaml"
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
URL = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                 r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?"
                 r"(?:/(?P<sub>[^/]+))?$")
TERM = re.compile(r"^(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\((.*)\))?$")
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
MERGE_KEYS = ("name", "containerPort", "port", "mountPath", "type", "ip")


def _parse_path(path: str, _parse: Callable[[str], parsing.ParsedPath] = parsing.parse_path,
                ) -> parsing.ParsedPath:
    try:
        return _parse(path)
    except ValueError:  # kmock 0.8 crashes on /api/v1/namespaces; Emulator routes URLs itself
        return parsing.ParsedPath()


parsing.parse_path = _parse_path


class Fail(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(code, reason, message)
        self.code, self.reason, self.message = code, reason, message


def merge(old: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; ``strategic`` also merges lists of dicts by a well-known key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, val in patch.items():
        items = val + out.get(key, []) if isinstance(val, list) else []
        mk = next((k for k in MERGE_KEYS if items and all(
            isinstance(i, dict) and k in i for i in items)), None)
        if strategic and key.startswith("$"):
            continue  # $patch/$setElementOrder/$retainKeys directives are not emulated
        elif val is None:
            out.pop(key, None)
        elif strategic and mk and isinstance(out.get(key), list):
            merged = {item[mk]: item for item in out[key]}
            for item in val:
                merged[item[mk]] = merge(merged.get(item[mk]), item, True)
                if item.get("$patch") == "delete":
                    del merged[item[mk]]
            out[key] = list(merged.values())
        else:
            out[key] = merge(out.get(key), val, strategic)
    return out


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 add/replace/remove/test; a failed ``test`` is a 422, as kopf expects."""
    doc = copy.deepcopy(doc)
    try:
        for op in ops:
            *parents, last = [p.replace("~1", "/").replace("~0", "~")
                              for p in op["path"].split("/")[1:]]
            node: Any = doc
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            idx: Any = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
            current = node.get(idx) if isinstance(node, dict) else node[idx]
            if op["op"] == "test" and current != op["value"]:
                raise Fail(422, "Invalid", f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del node[idx]
            elif op["op"] == "add" and isinstance(node, list):
                node.insert(idx, op["value"])
            elif op["op"] in ("add", "replace"):
                node[idx] = op["value"]
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise Fail(422, "Invalid", f"cannot apply the JSON patch: {e!r}") from e
    return doc


def selects(selector: str, get: Callable[[str], Any]) -> bool:
    """Evaluate a label/field selector (``a=b,c!=d,e in (x,y),f notin (z),g,!h``)."""
    for term in filter(None, (t.strip() for t in re.split(r",(?![^()]*\))", selector))):
        if not (m := TERM.match(term)):
            raise Fail(400, "BadRequest", f"unable to parse selector {term!r}")
        neg, key, op, val, setop, vals = m.groups()
        have, choices = get(key), {v.strip() for v in (vals or "").split(",")}
        have = None if have is None else str(have)
        if not (have == val if op in ("=", "==") else have != val if op == "!=" else
                have in choices if setop == "in" else have not in choices if setop else
                (have is None) == bool(neg)):
            return False
    return True


def dig(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with Kubernetes semantics for every resource URL."""

    rv: int = 0
    log: list[tuple[int, kmock.resource, Obj]] = attrs.field(factory=list)  # all watch events
    custom: set[kmock.resource] = attrs.field(factory=set)  # defined by CRDs
    changed: asyncio.Event = attrs.field(factory=asyncio.Event)
    closing: bool = False

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
        if since in ("", "0"):  # no resume point: the current state as ADDED events, then live
            events = [{"type": "ADDED", "object": o} for _, o in self.live(res)
                      if self.matches(ns, params, o)]
            pos = len(self.log)
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


class KubeEmulator:
    """A running ``Emulator`` (``.handler``) served on ``.url`` from a background thread."""

    def __init__(self, handler: Emulator, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.handler, self.url, self.loop = handler, url, loop

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the emulator's event loop (its state is not thread-safe)."""
        async def run() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(kubernetes.client.Configuration(host=self.url))

    def resource(self, name: str) -> kmock.resource:
        """Resolve ``'apps/v1/deployments'``, ``'deployments'``, ``'Deployment'`` or ``'llms'``."""
        infos = {r: self.handler.resources[r] for r in self.handler.resources}
        found = [r for r, i in infos.items() if "/" not in (r.plural or "") and (
            name in (r.plural, i.kind, i.singular) or name in i.shortnames)]
        if "/" in name or not found:
            return kmock.resource(name)
        return min(found, key=lambda r: (r.group not in ("", "apps"), r.group or ""))

    def objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Copies of the stored live objects of a resource (of all namespaces if None)."""
        res = self.resource(resource)
        return self.call(lambda: [copy.deepcopy(o) for (_, ns, _), o in self.handler.live(res)
                                  if namespace is None or ns == namespace])

    def get(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        found = [o for o in self.objects(resource, namespace) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def set_status(self, resource: str, namespace: str | None, name: str, status: Obj) -> Obj:
        """Merge ``status`` into an object's status as its controller would."""
        key = (self.resource(resource), namespace, name)
        return self.call(lambda: self.handler.update(
            key, merge(self.handler.read(key), {"status": status}), "status"))


@contextlib.contextmanager
def kube_emulator(*crds: Path) -> Iterator[KubeEmulator]:
    """Serve an emulator with these CRD files (default: the LLMService CRD) already created."""
    loop, started, stop, result = asyncio.new_event_loop(), threading.Event(), asyncio.Event(), []

    async def main() -> None:
        async with Emulator() as handler, kmock.Server(handler) as server:
            handler.create(kmock.resource("v1/namespaces"), None, {"metadata": {"name": "default"}})
            for path in crds or (CRD_PATH,):
                handler.create(CRDS, None, yaml.safe_load(path.read_text()))
            result.append(KubeEmulator(handler, str(server.url).rstrip("/"), loop))
            started.set()
            await stop.wait()
            handler.closing = True  # ends the watch streams, so that the server can close
            handler.changed.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the Kubernetes emulator did not start")
    try:
        yield result[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def run_operator(emu: KubeEmulator, registry: kopf.OperatorRegistry | None = None, *,
                 module: str | None = None, namespaces: tuple[str, ...] = ("default",),
                 clusterwide: bool = False, settings: kopf.OperatorSettings | None = None,
                 ) -> Iterator[kopf.OperatorRegistry]:
    """Run kopf (standalone) in a thread against ``emu`` with the handlers of ``registry``
    and/or of ``module`` ((re)imported into that registry); stop it cleanly on exit."""
    registry = registry or kopf.OperatorRegistry()
    if module:
        previous = kopf.get_default_registry()
        kopf.set_default_registry(registry)
        try:
            mod = sys.modules.get(module)
            importlib.reload(mod) if mod else importlib.import_module(module)
        finally:
            kopf.set_default_registry(previous)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=emu.url)

    stop, ready, errors = threading.Event(), threading.Event(), []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(
                registry=registry, settings=settings, standalone=True, clusterwide=clusterwide,
                namespaces=() if clusterwide else namespaces, stop_flag=stop, ready_flag=ready))
        except BaseException as e:
            errors.append(e)
            ready.set()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    ready.wait(30)
    try:
        if errors:
            raise RuntimeError("kopf failed to start") from errors[0]
        yield registry
    finally:
        stop.set()
        thread.join(30)


def eventually(fn: Callable[[], T], timeout: float = 15.0) -> T:
    """Poll ``fn`` until it returns something truthy; its last result otherwise fails."""
    deadline = time.monotonic() + timeout
    while not (result := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result, f"{fn!r} stayed falsy for {timeout}s"
    return result
