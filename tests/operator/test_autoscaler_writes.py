"""What the Kubernetes autoscaler writes to the API server, and how it fares when a write fails:
the reconcile leaves an autoscaled role's replicas alone after creating it, a stuck API server
cannot hold a call forever, and one role's refused scale neither blocks nor hides the other's.
(The autoscaler's pure pieces: test_autoscaler_backend.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar

import pytest
import urllib3
from kmock_support import KubeEmulator, kube_emulator
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from service_support import AUTO, spec_of

from cleave.autoscaling.flips import FlipPlan
from cleave.autoscaling.loop import AutoscalerLoop, Observed
from cleave.autoscaling.policy import Decision
from cleave.operator.autoscaler.controller import KubeBackend
from cleave.operator.kube import Kube
from cleave.operator.reconcile import reconcile
from cleave.operator.spec import parse_spec


@pytest.fixture()
def emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


def test_reconcile_creates_an_autoscaled_role_at_min_and_never_writes_it_again(
        emu: KubeEmulator) -> None:
    objects = client.CustomObjectsApi(emu.api_client())
    objects.create_namespaced_custom_object("cleave.dev", "v1alpha1", "default", "llmservices",
                                            spec_of(AUTO, {"replicas": 1}))
    kube = Kube(emu.api_client())
    obj = emu.get("llmservices", "default", "chat")
    assert obj is not None
    reconcile(kube, obj)
    assert emu.get("deployments", "default", "chat-prefill")["spec"]["replicas"] == 2  # type: ignore[index]
    assert kube.scale("default", "chat-prefill", 4)  # the autoscaler's move
    outcome = reconcile(kube, obj)
    assert outcome.actions == []
    assert emu.get("deployments", "default", "chat-prefill")["spec"]["replicas"] == 4  # type: ignore[index]
    assert not kube.scale("default", "gone", 1)  # a missing Deployment is not an error


def test_a_stuck_api_server_cannot_hold_a_call_forever() -> None:
    """The autoscaler loop and the reconcile call the API from threads; the client's default
    is to wait forever for an answer, which would freeze them for good."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []  # accepted, never answered

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.getsockname()[1]}"
    kube = Kube(client.ApiClient(config), timeout_s=(0.5, 0.5))
    try:
        for call in (lambda: kube.pods("default", {"a": "b"}),
                     lambda: kube.scale("default", "chat-decode", 2),
                     lambda: kube.get({"apiVersion": "apps/v1", "kind": "Deployment",
                                       "metadata": {"name": "d", "namespace": "default"}})):
            outcome: list[BaseException] = []

            def attempt(call: Callable[[], object] = call,
                        outcome: list[BaseException] = outcome) -> None:
                try:
                    call()
                except BaseException as e:  # inspected below
                    outcome.append(e)

            worker = threading.Thread(target=attempt, daemon=True)  # a hang fails, not blocks
            worker.start()
            worker.join(timeout=20)  # a few bounded retries, not forever
            assert not worker.is_alive(), "the API call is still waiting"
            assert len(outcome) == 1 and isinstance(outcome[0], urllib3.exceptions.HTTPError)
    finally:
        server.close()
        for c in held:
            c.close()


class DecodeScaleFails(Kube):
    """The API refuses one role's scale (a transient 500, an admission webhook)."""

    def scale(self, namespace: str, deployment: str, replicas: int) -> bool:
        if deployment.endswith("-decode"):
            raise ApiException(status=500, reason="Internal Server Error")
        return super().scale(namespace, deployment, replicas)


class Seen(KubeBackend):
    """The Kubernetes backend observing set counts: two roles scaled each on its own."""

    current: ClassVar[dict[str, int]] = {"decode": 1, "prefill": 2}

    async def observe(self, now: float) -> Observed | None:
        return Observed({}, dict(self.current), dict(self.current))


class Wants:
    """A decider asking for fixed replicas (the policy has tests of its own)."""

    colocate = False

    def __init__(self, desired: dict[str, int]) -> None:
        self.desired = desired

    def decide(self, now: float, obs: Observed) -> list[Decision]:
        return [Decision(r, obs.current[r], n, f"{r} asks for {n}", {})
                for r, n in self.desired.items()]

    def plan(self, now: float, obs: Observed, desired: Mapping[str, int]) -> FlipPlan:
        raise AssertionError("no flips without elastic roles")


async def test_one_failed_scale_neither_blocks_the_other_role_nor_hides_a_done_one(
        emu: KubeEmulator) -> None:
    both = spec_of(AUTO, {"autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                          "tpotSeconds": 0.05}})
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(
        "cleave.dev", "v1alpha1", "default", "llmservices", both)
    obj = emu.get("llmservices", "default", "chat")
    assert obj is not None
    await asyncio.to_thread(reconcile, Kube(emu.api_client()), obj)
    told: list[tuple[str, str]] = []
    backend = Seen(DecodeScaleFails(emu.api_client()))
    backend.spec, backend.post_event = parse_spec(obj), lambda *e: told.append(e)
    loop = AutoscalerLoop(backend, Wants({"decode": 3, "prefill": 4}))
    tick = await loop.tick(0.0)
    assert tick is not None and [(c.role, c.desired) for c in tick.done] == [("prefill", 4)]
    assert emu.get("deployments", "default", "chat-prefill")["spec"]["replicas"] == 4  # type: ignore[index]
    assert emu.get("deployments", "default", "chat-decode")["spec"]["replicas"] == 1  # type: ignore[index]
    # The scale that happened is told everywhere; the one that did not is not claimed.
    status = (emu.get("llmservices", "default", "chat") or {})["status"]["autoscaler"]
    assert [(d["role"], d["desired"]) for d in status["decisions"]] == [("prefill", 4)]
    assert told == [("ScaledUp", "prefill 2 -> 4: prefill asks for 4")]
    # The failed one is found again at the next tick, and told once it is done.
    backend.kube, backend.current = Kube(emu.api_client()), {"decode": 1, "prefill": 4}
    again = await loop.tick(1.0)
    assert again is not None and [(c.role, c.desired) for c in again.done] == [("decode", 3)]
