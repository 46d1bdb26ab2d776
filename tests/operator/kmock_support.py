"""A Kubernetes API emulator for operator tests: kmock 0.8 plus the fixes a kopf operator needs.

``Emulator`` keeps kmock's object store, discovery and HTTP server, and serves resource URLs
itself: uid/resourceVersion/generation/creationTimestamp, 201 on create, errors as ``Status``,
PUT, merge/strategic-merge/JSON patches, ``status`` and ``scale`` subresources, label and field
selectors, watches resumed from a resourceVersion, watch lists (``sendInitialEvents`` with the
initial-events-end bookmark kubectl 1.35 waits for), finalizers, CRDs added to discovery when
created, and garbage collection of dependents whose owners are all gone (after each removal).
``kube_emulator()`` serves it on a free 127.0.0.1 port from a thread with its own event loop, so
sync clients (``kubernetes``, ``kubectl``) and kopf (``run_operator()``) can all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kopf
import kubernetes.client
import yaml
from kmock_emulator import CRDS, Emulator
from kmock_semantics import Obj, merge

T = TypeVar("T")
CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "llmservice.yaml"


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
def operator_emulator() -> Iterator[KubeEmulator]:
    """An emulator that the operator's own API client (the kubernetes default) talks to."""
    with kube_emulator() as emulator:
        config = kubernetes.client.Configuration()
        config.host = emulator.url
        kubernetes.client.Configuration.set_default(config)
        yield emulator


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


def eventually(fn: Callable[[], T], timeout: float = 60.0) -> T:
    """Poll ``fn`` until it returns something truthy; its last result otherwise fails.

    The bound is generous on purpose: it costs nothing when ``fn`` comes true, and a loaded
    2-core CI box can take tens of seconds to start an operator and run its first ticks."""
    deadline = time.monotonic() + timeout
    while not (result := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result, f"{fn!r} stayed falsy for {timeout}s"
    return result
