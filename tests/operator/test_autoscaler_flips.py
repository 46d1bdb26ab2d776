"""Elastic roles on Kubernetes: kopf against the API emulator, worker pods that are real HTTP
servers (``/metrics``, ``/internal/stats`` and ``/internal/role`` as a worker serves them). A
starved prefill role is met by flipping a decode pod the decode role can spare: the pod is
asked to change role, no Deployment changes, and the status and an Event say so."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from autoscaler_pods import FakePod, Profile, create_pod
from kmock_support import KubeEmulator, eventually, operator_emulator, run_operator
from kubernetes import client

NS = "default"
CR = ("cleave.dev", "v1alpha1", NS, "llmservices")
HANDLERS = "cleave.operator.handlers"


class Workers:
    """Fake worker pods, each on its own 127.0.0.1 port, served from one thread's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []
        self.flips: list[tuple[int, str]] = []  # (port, role) asked of each pod
        self.auth: set[str | None] = set()  # the Authorization headers /internal/* got

    def add(self, profile: Profile) -> int:
        pod = FakePod(profile)
        port_box: list[int] = []

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=pod.render(), content_type="text/plain")

        async def stats(request: web.Request) -> web.Response:
            self.auth.add(request.headers.get("Authorization"))
            return web.json_response({"role": pod.profile.role, "kv_usage": 0.0})

        async def role(request: web.Request) -> web.Response:
            self.auth.add(request.headers.get("Authorization"))
            wanted = (await request.json())["role"]
            self.flips.append((port_box[0], wanted))
            pod.profile.role = wanted  # its figures now carry the new role, as a worker's do
            return web.json_response({"role": wanted})

        async def start() -> int:
            app = web.Application()
            app.router.add_get("/metrics", metrics)
            app.router.add_get("/internal/stats", stats)
            app.router.add_post("/internal/role", role)
            runner = web.AppRunner(app)
            await runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
            self.runners.append(runner)
            return int(sock.getsockname()[1])

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        port_box.append(port)
        return port

    def close(self) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture()
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeEmulator]:
    monkeypatch.setenv("CLEAVE_RECHECK_SECONDS", "0.5")
    monkeypatch.setenv("CLEAVE_AUTOSCALE_SECONDS", "0.3")
    with operator_emulator() as emulator:
        yield emulator


@pytest.fixture()
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


def replicas(emu: KubeEmulator, deployment: str) -> int | None:
    found = emu.get("deployments", NS, deployment)
    return None if found is None else found["spec"].get("replicas")


def events(emu: KubeEmulator, name: str, reason: str) -> list[str]:
    return [e["message"] for e in emu.objects("events", NS)
            if e.get("involvedObject", {}).get("name") == name and e["reason"] == reason]


def test_a_starved_prefill_role_gets_a_flipped_decode_pod(emu: KubeEmulator,
                                                          workers: Workers) -> None:
    spec: dict[str, Any] = {
        "model": {"name": "m", "source": "m"}, "kvStore": {"managed": {}},
        "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "ttftSeconds": 0.5}},
        "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "tpotSeconds": 1.0}},
        "autoscaling": {"scaleDownDelaySeconds": 0}}
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, {
        "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": NS}, "spec": spec})
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-decode") == 1)
        client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
            "chat-decode", NS, {"spec": {"replicas": 2}})  # an earlier scale-up
        # Prefill: p90 TTFT 0.975 s against 0.5 s asks for 2. Decode: TPOT far under its
        # target, so one of its two pods can go.
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-a",
                   workers.add(Profile("prefill", ttft=0.9, tokens_per_scrape=500)))
        cool = {name: workers.add(Profile("decode", tpot=0.01, tokens_per_scrape=300))
                for name in ("chat-decode-a", "chat-decode-b")}
        for name, port in cool.items():
            create_pod(emu, NS, "chat", "decode", name, port)
        [(port, role)] = eventually(lambda: workers.flips)
        assert role == "prefill" and port in cool.values()
        flipped = next(n for n, p in cool.items() if p == port)
        [message] = eventually(lambda: events(emu, "chat", "Flipped"))
        assert message.startswith(f"pod {flipped} now serves the prefill role")
        decisions = eventually(lambda: (emu.get("llmservices", NS, "chat")["status"]
                                        .get("autoscaler") or {}).get("decisions"))
        prefill = next(d for d in decisions if d["role"] == "prefill")
        assert (prefill["current"], prefill["desired"]) == (1, 2)
        assert f"plan: {flipped} -> prefill" in prefill["reason"]
        # A flip moves a warm pod: no Deployment was scaled for it, and once flipped the
        # counts per current role meet the decisions, so nothing more happens.
        assert (replicas(emu, "chat-prefill"), replicas(emu, "chat-decode")) == (1, 2)
        # Every /internal/* call carried the service's internal token (workers refuse others).
        secret = emu.get("secrets", NS, "chat-internal-token")
        assert secret is not None
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert workers.auth == {f"Bearer {token}"}
        time.sleep(1.5)
        assert len(workers.flips) == 1
        assert (replicas(emu, "chat-prefill"), replicas(emu, "chat-decode")) == (1, 2)


def test_a_quiet_service_goes_down_to_one_pod_serving_both_roles(emu: KubeEmulator,
                                                                 workers: Workers) -> None:
    """The one-worker floor on Kubernetes: the policy finds the load fits one worker (for the
    scale-down delay, 0 here), the operator flips one pod to ``both`` and removes the other."""
    spec: dict[str, Any] = {
        "model": {"name": "m", "source": "m"}, "kvStore": {"managed": {}},
        "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "ttftSeconds": 2.0,
                                    "tokensPerSecondPerReplica": 100000}},
        "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "tpotSeconds": 1.0,
                                   "tokensPerSecondPerReplica": 100000}},
        "autoscaling": {"scaleDownDelaySeconds": 0}}
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, {
        "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": NS}, "spec": spec})
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-decode") == 1)
        # A trickle: tens of tokens/s against 100,000 per replica.
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-a",
                   workers.add(Profile("prefill", ttft=0.2, tokens_per_scrape=5)))
        decode = workers.add(Profile("decode", tpot=0.01, tokens_per_scrape=5))
        create_pod(emu, NS, "chat", "decode", "chat-decode-a", decode)
        [(port, role)] = eventually(lambda: workers.flips)
        assert role == "both"
        [message] = eventually(lambda: events(emu, "chat", "Flipped"))
        kept = "chat-decode-a" if port == decode else "chat-prefill-a"
        assert message.startswith(f"pod {kept} now serves the both role")
        # The other pod's Deployment goes to 0: one replica serves the service.
        eventually(lambda: sorted((replicas(emu, "chat-prefill"),
                                   replicas(emu, "chat-decode"))) == [0, 1])
        # Counted in both roles, the both-pod meets the decisions: nothing more happens.
        time.sleep(1.5)
        assert len(workers.flips) == 1
        assert sorted((replicas(emu, "chat-prefill"), replicas(emu, "chat-decode"))) == [0, 1]
