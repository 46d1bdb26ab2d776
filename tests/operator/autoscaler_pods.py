"""Synthetic pods for autoscaler tests: real HTTP servers serving Prometheus text like a worker's
or a router's ``/metrics``, plus the kmock pod objects that point the operator at them.

Each scrape of a pod is one interval of traffic: the pod observes ``per_scrape`` latencies of
its profile and grows its token counter, so windowed quantiles and rates have deltas to read, as
they would against a live worker. ``status`` other than 200 makes the pod fail its scrapes.
:class:`Workers` adds a worker's ``/internal/stats`` and ``/internal/role`` (elastic roles).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kmock_support import KubeEmulator
from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cleave.common import metric_names as names

# The runtime's buckets: the fake pods export what a worker does.
LATENCY_BUCKETS = names.LATENCY_BUCKETS
TPOT_BUCKETS = names.TPOT_BUCKETS


@dataclass
class Profile:
    role: str  # prefill, decode or router
    ttft: float | None = None  # seconds observed per request on a scrape
    tpot: float | None = None
    kv_usage: float = 0.0
    waiting: float = 0.0
    tokens_per_scrape: float = 0.0
    per_scrape: int = 10
    status: int = 200


class FakePod:
    """One pod's metrics registry, advanced by one interval of traffic per scrape."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.registry = CollectorRegistry()
        self.scrapes = 0
        r = self.registry
        self.ttft = Histogram(names.TTFT, "TTFT", ["role"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(names.TPOT, "TPOT", ["role"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.waiting = Gauge(names.WAITING, "waiting", ["role"], registry=r)
        self.kv = Gauge(names.KV_USAGE, "kv", ["role"], registry=r)
        self.prompt = Counter(names.PROMPT_TOKENS, "prompt tokens", ["role"], registry=r)
        self.generated = Counter(names.GENERATION_TOKENS, "output tokens", ["role"],
                                 registry=r)

    def render(self) -> bytes:
        p = self.profile
        self.scrapes += 1
        for _ in range(p.per_scrape):
            if p.ttft is not None:
                self.ttft.labels(p.role).observe(p.ttft)
            if p.tpot is not None:
                self.tpot.labels(p.role).observe(p.tpot)
        self.waiting.labels(p.role).set(p.waiting)
        if p.role != "router":
            self.kv.labels(p.role).set(p.kv_usage)
            tokens = self.prompt if p.role == "prefill" else self.generated
            tokens.labels(p.role).inc(p.tokens_per_scrape)
        return generate_latest(self.registry)


def metrics_reply(pod: FakePod) -> web.Response:
    """A pod's ``/metrics``: one interval of traffic, or its failure status."""
    if pod.profile.status != 200:
        return web.Response(status=pod.profile.status, text="unavailable")
    return web.Response(body=pod.render(), content_type="text/plain")


class _ServedPods:
    """Serves each fake pod's routes on its own 127.0.0.1 port, from a thread with its own event
    loop (the tests and the operator under test call them from other threads)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def serve(self, routes: list[web.RouteDef]) -> int:
        """Start a pod's server with ``routes``; its port."""
        async def start() -> int:
            app = web.Application()
            app.add_routes(routes)
            runner = web.AppRunner(app)
            await runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
            self.runners.append(runner)
            return int(sock.getsockname()[1])

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class PodServers(_ServedPods):
    """Pods that serve their ``/metrics`` (a router's, or a worker's of a fixed role)."""

    def add(self, profile: Profile) -> tuple[FakePod, int]:
        pod = FakePod(profile)

        async def metrics(_: web.Request) -> web.Response:
            return metrics_reply(pod)

        return pod, self.serve([web.get("/metrics", metrics)])


class Workers(_ServedPods):
    """Fake worker pods for elastic roles: ``/metrics`` as :class:`FakePod`, and
    ``/internal/stats`` and ``/internal/role`` as a worker serves them."""

    def __init__(self) -> None:
        super().__init__()
        self.flips: list[tuple[int, str]] = []  # (port, role) asked of each pod
        self.auth: set[str | None] = set()  # the Authorization headers /internal/* got
        self.slow: set[int] = set()  # ports that answer too late (a busy pod)...
        self.stall_s = 1.5  # ... by this much...
        self.slow_paths = {"/metrics", "/internal/stats"}  # ... on these paths

    def add(self, profile: Profile) -> int:
        pod = FakePod(profile)
        port_box: list[int] = []  # the port is known once the server is up

        async def stall(request: web.Request) -> None:
            if port_box[0] in self.slow and request.path in self.slow_paths:
                await asyncio.sleep(self.stall_s)

        async def metrics(request: web.Request) -> web.Response:
            await stall(request)
            return metrics_reply(pod)

        async def stats(request: web.Request) -> web.Response:
            self.auth.add(request.headers.get("Authorization"))
            await stall(request)
            return web.json_response({"role": pod.profile.role, "kv_usage": 0.0})

        async def role(request: web.Request) -> web.Response:
            self.auth.add(request.headers.get("Authorization"))
            wanted = (await request.json())["role"]
            self.flips.append((port_box[0], wanted))
            pod.profile.role = wanted  # its figures now carry the new role, as a worker's do
            await stall(request)  # a busy worker: switched, but its answer comes too late
            return web.json_response({"role": wanted})

        port_box.append(self.serve([web.get("/metrics", metrics),
                                    web.get("/internal/stats", stats),
                                    web.post("/internal/role", role)]))
        return port_box[0]


@contextlib.contextmanager
def pod_servers() -> Iterator[PodServers]:
    servers = PodServers()
    try:
        yield servers
    finally:
        servers.close()


def free_port() -> int:
    """A port nothing listens on: a pod there refuses every scrape."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def labels(service: str, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": service,
            "app.kubernetes.io/component": role,
            "app.kubernetes.io/managed-by": "cleave-operator"}


def create_pod(emu: KubeEmulator, namespace: str, service: str, role: str, name: str,
               port: int, ready: bool = True) -> dict[str, Any]:
    """A running pod of ``service``'s ``role`` as a ReplicaSet and kubelet would leave it: the
    container port named ``http`` and status.podIP say where its /metrics is."""
    client.CoreV1Api(emu.api_client()).create_namespaced_pod(namespace, {
        "metadata": {"name": name, "labels": labels(service, role)},
        "spec": {"containers": [{"name": role, "image": "x",
                                 "ports": [{"name": "http", "containerPort": port}]}]}})
    return emu.set_status("pods", namespace, name, {
        "phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True" if ready else "False"}]})
