"""The Kubernetes autoscaler, end to end: kopf against the API emulator, pods whose /metrics are
real HTTP servers serving synthetic Prometheus text → the role Deployments are scaled (or, when
they must not be, left alone) and the status, Events and metrics tell why."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from autoscaler_pods import PodServers, Profile, create_pod, free_port, pod_servers
from kmock_support import KubeEmulator, eventually, operator_emulator, run_operator
from kubernetes import client
from prometheus_client import REGISTRY

from cleave.common import metric_names as names

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
def servers() -> Iterator[PodServers]:
    with pod_servers() as s:
        yield s


def service(name: str, prefill: dict[str, Any], decode: dict[str, Any],
            **autoscaling: Any) -> dict[str, Any]:
    return {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"name": "m", "source": "m"}, "prefill": prefill,
                     "decode": decode, "kvStore": {"managed": {}},
                     "autoscaling": autoscaling}}


def create(emu: KubeEmulator, obj: dict[str, Any]) -> None:
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, obj)


def replicas(emu: KubeEmulator, deployment: str) -> int | None:
    found = emu.get("deployments", NS, deployment)
    return None if found is None else found["spec"].get("replicas")


def autoscaler_status(emu: KubeEmulator, name: str) -> dict[str, Any]:
    return dict((emu.get("llmservices", NS, name) or {}).get("status", {}).get("autoscaler")
                or {})


def events(emu: KubeEmulator, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e["message"]) for e in emu.objects("events", NS)
            if e.get("involvedObject", {}).get("name") == name
            and e["reason"] in ("ScaledUp", "ScaledDown", "WouldScaleUp", "WouldScaleDown")]


def writes(emu: KubeEmulator) -> int:
    return emu.call(lambda: len(emu.handler.log))


def metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def hot_prefill(servers: PodServers, emu: KubeEmulator, svc: str, pod: str) -> None:
    """A ready prefill pod whose p90 TTFT (0.975 s in the runtime's buckets) is 1.95x a 0.5 s
    target: the policy asks for ceil(1 x 1.95) = 2 replicas."""
    _, port = servers.add(Profile("prefill", ttft=0.9, tokens_per_scrape=500))
    create_pod(emu, NS, svc, "prefill", pod, port)


def test_high_ttft_scales_prefill_and_the_status_says_why(emu: KubeEmulator,
                                                          servers: PodServers) -> None:
    create(emu, service("chat", {"autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                                 "ttftSeconds": 0.5}}, {"replicas": 1}))
    labels = {"llmservice": "chat", "namespace": NS, "role": "prefill"}
    ups = metric(names.total(names.AUTOSCALER_DECISIONS), **labels, direction="up",
                 advisory="false") or 0.0
    with run_operator(emu, module=HANDLERS):
        # An autoscaled role's Deployment is created at its minimum.
        assert eventually(lambda: replicas(emu, "chat-prefill")) == 1
        hot_prefill(servers, emu, "chat", "chat-prefill-a")
        eventually(lambda: replicas(emu, "chat-prefill") == 2)
        block = eventually(lambda: autoscaler_status(emu, "chat").get("decisions")
                           and autoscaler_status(emu, "chat"))
        [decision] = block["decisions"]
        assert (decision["role"], decision["current"], decision["desired"]) == ("prefill", 1, 2)
        assert decision["advisory"] is False and block["dryRun"] is False
        assert decision["reason"].startswith("ttft asks for 2")
        inputs = decision["inputs"]
        assert float(inputs["latency_p90"]) == pytest.approx(0.975)
        assert (inputs["latency_target"], inputs["ready"], inputs["max"]) == ("0.5", "1", "4")
        assert block["desiredReplicas"] == {"prefill": 2}
        # One Event per change, its message the reason; the operator's metrics agree.
        reason, message = eventually(lambda: events(emu, "chat"))[0]
        assert reason == "ScaledUp" and message.startswith("prefill 1 -> 2: ttft asks for 2")
        assert metric(names.AUTOSCALER_DESIRED, **labels, advisory="false") == 2
        assert metric(names.total(names.AUTOSCALER_DECISIONS), **labels, direction="up",
                      advisory="false") == ups + 1
        # The fixed role is the reconcile's, never the autoscaler's.
        assert replicas(emu, "chat-decode") == 1
        # Settled: the new replica counts as starting until it exists, nothing flaps, and the
        # idle service (reconcile rechecks and autoscaler ticks) writes nothing at all.
        eventually(lambda: emu.get("llmservices", NS, "chat")["status"].get("prefill", {})
                   .get("desiredReplicas") == 2)
        before = writes(emu)
        time.sleep(2.5)
        assert writes(emu) == before
        assert replicas(emu, "chat-prefill") == 2
        assert len(autoscaler_status(emu, "chat")["decisions"]) == 1


@pytest.mark.parametrize(("profile", "signal"), [
    (Profile("decode", tpot=0.09, kv_usage=0.5, tokens_per_scrape=300), "tpot"),
    (Profile("decode", tpot=0.03, kv_usage=0.96, tokens_per_scrape=300), "kv"),
], ids=["tpot", "kv-usage"])
def test_high_tpot_or_kv_usage_scales_decode(emu: KubeEmulator, servers: PodServers,
                                             profile: Profile, signal: str) -> None:
    create(emu, service("chat", {"replicas": 1}, {"autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "tpotSeconds": 0.05, "kvCacheUsage": 0.8}}))
    with run_operator(emu, module=HANDLERS):
        assert eventually(lambda: replicas(emu, "chat-decode")) == 1
        _, port = servers.add(profile)
        create_pod(emu, NS, "chat", "decode", "chat-decode-a", port)
        eventually(lambda: replicas(emu, "chat-decode") == 2)
        decision = eventually(lambda: autoscaler_status(emu, "chat").get("decisions"))[0]
        assert decision["reason"].startswith(f"{signal} asks for 2")
        assert decision["inputs"]["kv_usage"] == f"{profile.kv_usage:g}"
        assert replicas(emu, "chat-prefill") == 1
        # Deleting the service ends its loop (kopf releases the finalizer) and its series.
        gauge = {"llmservice": "chat", "namespace": NS, "role": "decode", "advisory": "false"}
        assert metric(names.AUTOSCALER_DESIRED, **gauge) == 2
        client.CustomObjectsApi(emu.api_client()).delete_namespaced_custom_object(*CR, "chat")
        eventually(lambda: emu.get("llmservices", NS, "chat") is None
                   and emu.get("deployments", NS, "chat-decode") is None)
        eventually(lambda: metric(names.AUTOSCALER_DESIRED, **gauge) is None)


def test_a_pod_that_does_not_answer_holds_instead_of_scaling_down(
        emu: KubeEmulator, servers: PodServers) -> None:
    # Idle metrics would scale this role down at once (no delay); unanswered scrapes must not.
    create(emu, service("chat", {"autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                                 "ttftSeconds": 0.5}}, {"replicas": 1},
                        scaleDownDelaySeconds=0))
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-prefill") == 1)
        client.AppsV1Api(emu.api_client()).patch_namespaced_deployment_scale(
            "chat-prefill", NS, {"spec": {"replicas": 2}})  # an earlier scale-up
        failing = Profile("prefill", status=503)
        _, port = servers.add(failing)
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-a", port)
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-b", free_port())  # refuses
        time.sleep(3.0)  # ~10 ticks of stale data
        assert replicas(emu, "chat-prefill") == 2
        assert autoscaler_status(emu, "chat") == {}
        # The same pod answering with an idle profile is read as idle: the loop was alive.
        failing.status = 200
        eventually(lambda: replicas(emu, "chat-prefill") == 1)
        # The Deployment is scaled first, then the decision published: wait for the status.
        decision = eventually(lambda: autoscaler_status(emu, "chat").get("decisions"))[0]
        assert decision["reason"].startswith("idle: no queue and no tokens")
        assert (decision["current"], decision["desired"]) == (2, 1)


def test_external_and_disabled_services_are_never_scaled(emu: KubeEmulator,
                                                         servers: PodServers) -> None:
    prefill = {"replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                              "ttftSeconds": 0.5}}
    create(emu, service("ext", prefill, {"replicas": 1}, mode="External"))
    create(emu, service("off", prefill, {"replicas": 1}, mode="Disabled"))
    create(emu, service("on", prefill, {"replicas": 1}, mode="Cleave"))
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: all(emu.get("services", NS, f"{s}-router")  # the last child
                               for s in ("ext", "off", "on")))
        scale_calls = writes(emu)
        for svc in ("ext", "off", "on"):
            hot_prefill(servers, emu, svc, f"{svc}-prefill-a")
        eventually(lambda: replicas(emu, "on-prefill") == 2)  # the loop runs and acts
        time.sleep(1.0)
        # External: created at the spec's count, never written again (an HPA's from then on);
        # Disabled: the spec's fixed replicas, whatever the metrics say.
        assert replicas(emu, "ext-prefill") == 3  # created at the spec's count, then left
        assert replicas(emu, "off-prefill") == 3
        assert autoscaler_status(emu, "ext") == {} and autoscaler_status(emu, "off") == {}
        assert not events(emu, "ext") and not events(emu, "off")
        scaled = [obj for _, _, e in emu.call(lambda: emu.handler.log[scale_calls:])
                  if (obj := e["object"])["kind"] == "Deployment" and e["type"] == "MODIFIED"]
        assert {o["metadata"]["name"] for o in scaled} == {"on-prefill"}


def test_dry_run_records_the_decision_and_leaves_replicas_alone(
        emu: KubeEmulator, servers: PodServers) -> None:
    create(emu, service("chat", {"autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                                 "ttftSeconds": 0.5}}, {"replicas": 1},
                        dryRun=True))
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-prefill") == 1)
        hot_prefill(servers, emu, "chat", "chat-prefill-a")
        block = eventually(lambda: autoscaler_status(emu, "chat").get("decisions")
                           and autoscaler_status(emu, "chat"))
        [decision] = block["decisions"]
        assert block["dryRun"] is True and decision["advisory"] is True
        assert (decision["current"], decision["desired"]) == (1, 2)
        assert block["desiredReplicas"] == {"prefill": 2}
        reason, message = eventually(lambda: events(emu, "chat"))[0]
        assert reason == "WouldScaleUp" and message.startswith("advisory (dryRun): prefill 1")
        assert metric(names.AUTOSCALER_DESIRED, llmservice="chat", namespace=NS,
                      role="prefill", advisory="true") == 2
        time.sleep(1.5)  # a standing recommendation is told once, and never acted on
        assert replicas(emu, "chat-prefill") == 1
        assert len(autoscaler_status(emu, "chat")["decisions"]) == 1
        # Turning dryRun off lets the same recommendation act.
        client.CustomObjectsApi(emu.api_client()).patch_namespaced_custom_object(
            *CR, "chat", {"spec": {"autoscaling": {"dryRun": False}}})
        eventually(lambda: replicas(emu, "chat-prefill") == 2)
        block = eventually(lambda: autoscaler_status(emu, "chat")["dryRun"] is False
                           and autoscaler_status(emu, "chat"))
        assert [d["advisory"] for d in block["decisions"]] == [False, True]


def test_coordinated_scale_from_and_to_zero(emu: KubeEmulator, servers: PodServers) -> None:
    zero = {"minReplicas": 0, "maxReplicas": 2}
    create(emu, service("chat", {"autoscaling": {**zero, "ttftSeconds": 0.5}},
                        {"autoscaling": {**zero, "tpotSeconds": 0.05}},
                        scaleToZero=True, scaleDownDelaySeconds=0))
    with run_operator(emu, module=HANDLERS):
        eventually(lambda: replicas(emu, "chat-prefill") == 0
                   and replicas(emu, "chat-decode") == 0)
        # At zero only the router sees demand: the requests it holds wake both roles.
        router = Profile("router", waiting=3)
        _, port = servers.add(router)
        create_pod(emu, NS, "chat", "router", "chat-router-a", port)
        eventually(lambda: replicas(emu, "chat-prefill") == 1
                   and replicas(emu, "chat-decode") == 1)
        # The status is written right after the scale: poll it too, never read it once.
        def reasons() -> dict[str, str]:
            return {d["role"]: d["reason"]
                    for d in autoscaler_status(emu, "chat").get("decisions", [])}

        eventually(lambda: reasons().get("prefill", "").startswith("demand while at zero"))
        # Served and idle again: both roles go back to zero together.
        router.waiting = 0
        for role in ("prefill", "decode"):
            _, port = servers.add(Profile(role))
            create_pod(emu, NS, "chat", role, f"chat-{role}-a", port)
        eventually(lambda: replicas(emu, "chat-prefill") == 0
                   and replicas(emu, "chat-decode") == 0)
        def latest() -> set[tuple[str, int, int]]:
            return {(d["role"], d["current"], d["desired"])
                    for d in autoscaler_status(emu, "chat").get("decisions", [])[:2]}

        eventually(lambda: latest() == {("prefill", 1, 0), ("decode", 1, 0)})
