"""Elastic roles on Kubernetes: kopf against the API emulator, worker pods that are real HTTP
servers (``/metrics``, ``/internal/stats`` and ``/internal/role`` as a worker serves them). A
starved prefill role is met by flipping a decode pod the decode role can spare: the pod is
asked to change role, no Deployment changes, and the status and an Event say so. A flipped pod
whose stats come too late (a busy pod) is still counted where it works, so it is not replaced
by a new replica nor flipped again."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from autoscaler_pods import Profile, Workers, create_pod
from kmock_support import (
    KubeEmulator,
    eventually,
    kube_emulator,
    operator_emulator,
    run_operator,
)
from kubernetes import client

from cleave.operator.autoscaler.controller import ServiceAutoscaler
from cleave.operator.kube import Kube
from cleave.operator.reconcile import reconcile

NS = "default"
CR = ("cleave.dev", "v1alpha1", NS, "llmservices")
HANDLERS = "cleave.operator.handlers"


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


def decisions(emu: KubeEmulator) -> list[dict[str, Any]]:
    """``status.autoscaler.decisions`` of the service ``chat``, newest first."""
    found = emu.get("llmservices", NS, "chat") or {}
    return list(((found.get("status") or {}).get("autoscaler") or {}).get("decisions") or [])


def create_chat(emu: KubeEmulator, ttft_s: float = 0.5, **capacity: Any) -> None:
    """Create the LLMService ``chat``: both roles autoscaled 1..2 replicas (prefill against a
    TTFT of ``ttft_s``, decode a TPOT of 1 s), scaled down without delay; ``capacity`` goes
    into both roles' autoscaling (``tokensPerSecondPerReplica``)."""
    spec = {"model": {"name": "m", "source": "m"}, "kvStore": {"managed": {}},
            "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                                        "ttftSeconds": ttft_s, **capacity}},
            "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2, "tpotSeconds": 1.0,
                                       **capacity}},
            "autoscaling": {"scaleDownDelaySeconds": 0}}
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, {
        "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": NS}, "spec": spec})


def test_a_starved_prefill_role_gets_a_flipped_decode_pod(emu: KubeEmulator,
                                                          workers: Workers) -> None:
    create_chat(emu)
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-decode") == 1)
        client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
            "chat-decode", NS, {"spec": {"replicas": 2}})  # an earlier scale-up
        # Prefill: p90 TTFT 0.975 s against 0.5 s asks for 2. Decode: TPOT far under its
        # target, so one of its two pods can go. The pods serve figures only once all three
        # exist: a tick that saw some of them would rightly plan for those alone.
        profiles = [Profile("prefill", ttft=0.9, tokens_per_scrape=500, status=503),
                    *(Profile("decode", tpot=0.01, tokens_per_scrape=300, status=503)
                      for _ in "ab")]
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-a", workers.add(profiles[0]))
        cool = {name: workers.add(profile)
                for name, profile in zip(("chat-decode-a", "chat-decode-b"), profiles[1:],
                                         strict=True)}
        for name, port in cool.items():
            create_pod(emu, NS, "chat", "decode", name, port)
        for profile in profiles:
            profile.status = 200
        [(port, role)] = eventually(lambda: workers.flips)
        assert role == "prefill" and port in cool.values()
        flipped = next(n for n, p in cool.items() if p == port)
        [message] = eventually(lambda: events(emu, "chat", "Flipped"))
        assert message.startswith(f"pod {flipped} now serves the prefill role")
        # The decision that carried the flip is in the status (among the last ones told: a
        # later tick may tell another decision before this is read).
        [prefill] = eventually(lambda: [d for d in decisions(emu) if d["role"] == "prefill"
                                        and f"plan: {flipped} -> prefill" in d["reason"]])
        assert (prefill["current"], prefill["desired"]) == (1, 2)
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
        assert not [d for d in decisions(emu) if "start" in d["reason"]]  # no replica planned


def test_a_quiet_service_goes_down_to_one_pod_serving_both_roles(emu: KubeEmulator,
                                                                 workers: Workers) -> None:
    """The one-worker floor on Kubernetes: the policy finds the load fits one worker (for the
    scale-down delay, 0 here), the operator flips one pod to ``both`` and removes the other."""
    create_chat(emu, ttft_s=2.0, tokensPerSecondPerReplica=100000)
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


@pytest.fixture()
def plain_emu() -> Iterator[KubeEmulator]:
    with kube_emulator() as emulator:
        yield emulator


async def starved_prefill(emu: KubeEmulator, workers: Workers) -> list[int]:
    """``chat`` set up by the reconcile, with a hot prefill pod and two cool decode pods
    (decode scaled to 2 earlier): a tick flips one decode pod. The decode pods' ports."""
    create_chat(emu)
    kube = Kube(emu.api_client())
    await asyncio.to_thread(reconcile, kube, emu.get("llmservices", NS, "chat") or {})
    assert kube.scale(NS, "chat-decode", 2)
    create_pod(emu, NS, "chat", "prefill", "chat-prefill-a",
               workers.add(Profile("prefill", ttft=0.9, tokens_per_scrape=500)))
    decode = [workers.add(Profile("decode", tpot=0.01, tokens_per_scrape=300)) for _ in "ab"]
    for name, port in zip(("chat-decode-a", "chat-decode-b"), decode, strict=True):
        create_pod(emu, NS, "chat", "decode", name, port)
    return decode


class Ticks:
    """The autoscaler of ``chat`` (scrape timeout 0.3 s) ticked by hand, one second apart;
    ``told``: the Events it posted."""

    def __init__(self, emu: KubeEmulator, session: aiohttp.ClientSession) -> None:
        self.emu, self.session, self.now = emu, session, 0.0
        self.autoscaler = ServiceAutoscaler(Kube(emu.api_client()), scrape_timeout_s=0.3)
        self.told: list[tuple[str, str]] = []

    async def __call__(self) -> None:
        obj = await asyncio.to_thread(self.emu.get, "llmservices", NS, "chat")
        assert obj is not None
        await self.autoscaler.run_once(obj, self.session, self.now,
                                       lambda *e: self.told.append(e))
        self.now += 1

    async def until_a_flip(self, workers: Workers) -> None:
        while not workers.flips and self.now < 5:
            await self()


async def test_a_flipped_pod_whose_stats_time_out_is_not_replaced_by_a_new_replica(
        plain_emu: KubeEmulator, workers: Workers) -> None:
    """A busy pod's ``/internal/stats`` may miss the scrape timeout. The flipped pod is still
    in its new role (only a restart brings it home): the ticks after the flip must count it
    there, not plan a new prefill replica (a GPU for nothing) nor a second flip."""
    emu = plain_emu
    decode = await starved_prefill(emu, workers)
    async with aiohttp.ClientSession() as session:
        tick = Ticks(emu, session)
        await tick.until_a_flip(workers)
        [(port, role)] = workers.flips
        assert role == "prefill" and port in decode
        flip_tick = sorted(r for r, _ in tick.told)  # the flip, and the two roles' decisions
        assert flip_tick == ["Flipped", "ScaledDown", "ScaledUp"], tick.told
        # From now on the decode pods (the flipped one included) answer too late: the ticks
        # read neither their roles nor their figures.
        workers.slow.update(decode)
        for _ in range(3):
            await tick()
    assert len(workers.flips) == 1, workers.flips  # no flip back, no second flip
    assert len(tick.told) == len(flip_tick), tick.told  # nothing more decided, nothing scaled
    assert (replicas(emu, "chat-prefill"), replicas(emu, "chat-decode")) == (1, 2)


async def test_a_flip_answered_too_late_counts_the_pod_in_the_role_asked(
        plain_emu: KubeEmulator, workers: Workers) -> None:
    """A busy worker takes the role it is asked but answers after the timeout, and its stats
    miss the timeout too: the operator cannot tell whether it switched. It counts the pod in
    the role asked, so the same shortfall gets neither a second flip nor a new replica."""
    emu = plain_emu
    decode = await starved_prefill(emu, workers)
    workers.slow.update(decode)  # busy decode pods: their figures come in time, no more
    workers.slow_paths = {"/internal/stats", "/internal/role"}
    async with aiohttp.ClientSession() as session:
        tick = Ticks(emu, session)
        await tick.until_a_flip(workers)
        [(port, role)] = workers.flips
        assert role == "prefill" and port in decode
        for _ in range(3):
            await tick()
    assert len(workers.flips) == 1, workers.flips  # no flip back, no second flip
    reasons = [d["reason"] for d in decisions(emu)]
    assert reasons and not [r for r in reasons if "start" in r], reasons  # no replica planned
    assert (replicas(emu, "chat-prefill"), replicas(emu, "chat-decode")) == (1, 2)
