"""The chart's RBAC against the API calls the operator really makes (issue 15), both ways.

The real operator (kopf, the handlers, the autoscaler) runs against the API emulator, which
records every request with who made it; a service's life drives every path that calls the API:
create (children, Secrets, Events), status, the autoscaler's scale, a changed spec (each child
kind patched), the NetworkPolicies' peers changed, a role removed and the managed Redis
switched to an external one (pruning), an HPA taking a Deployment over. Each request becomes
the apiserver's authorization attributes (tests/cluster/localnode/rbac.py), and a child created
with a ``blockOwnerDeletion`` owner reference also needs ``update`` on ``llmservices/
finalizers`` (the OwnerReferencesPermissionEnforcement admission check). Then: every call is
granted by the chart's ClusterRole, and every grant is used (granted but unused: 0).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes import client

# Here, not with the operator's tests, so that the reliability run reports its figure
# (``reliability {"test": "rbac_verbs", ...}``); it runs once, with the operator's helpers.
TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS / "operator", TESTS / "cluster", TESTS / "charts"):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

from autoscaler_pods import PodServers, Profile, create_pod, pod_servers  # noqa: E402
from chart_support import HELM, by_kind, template  # noqa: E402
from figures import report  # noqa: E402
from kmock_support import KubeEmulator, eventually, operator_emulator, run_operator  # noqa: E402
from localnode.rbac import User, request_attributes  # noqa: E402

NS = "default"
CR = ("cleave.dev", "v1alpha1", NS, "llmservices")
TOKEN = "Bearer the-operator"  # the operator's own API client sends it: its calls, not ours
Use = tuple[str, str, str]  # (verb, apiGroup, resource or resource/subresource)


@pytest.fixture()
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeEmulator]:
    monkeypatch.setenv("CLEAVE_RECHECK_SECONDS", "0.3")
    monkeypatch.setenv("CLEAVE_AUTOSCALE_SECONDS", "0.3")
    with operator_emulator() as emulator:
        plain = kubernetes.client.Configuration.get_default_copy()
        config = kubernetes.client.Configuration.get_default_copy()
        config.api_key = {"authorization": TOKEN.split()[1]}
        config.api_key_prefix = {"authorization": "Bearer"}
        kubernetes.client.Configuration.set_default(config)  # the operator's client: marked
        try:
            yield emulator
        finally:
            kubernetes.client.Configuration.set_default(plain)


@pytest.fixture()
def servers() -> Iterator[PodServers]:
    with pod_servers() as s:
        yield s


def granted() -> set[Use]:
    """What the chart's default render grants the operator (its ClusterRole's rules)."""
    if not HELM.is_file():
        pytest.fail(f"{HELM} not found: run tools/fetch-helm.sh")
    out: set[Use] = set()
    for role in by_kind(template(), "ClusterRole"):
        for rule in role["rules"]:
            out |= {(v, g, r) for v in rule["verbs"] for g in rule["apiGroups"]
                    for r in rule["resources"]}
    return out


def used(emu: KubeEmulator) -> set[Use]:
    out: set[Use] = set()
    for method, target, actor in emu.call(lambda: list(emu.handler.requests)):
        if actor not in ("kopf", TOKEN):
            continue  # the test's own calls
        a = request_attributes(method, target, User("operator"))
        if a.resource_request:
            resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
            out.add((a.verb, a.api_group, resource))
    return out


def owner_blocks(emu: KubeEmulator) -> bool:
    """Whether a child carries an owner reference with blockOwnerDeletion to an LLMService:
    creating it needs ``update`` on ``llmservices/finalizers`` where owner references are
    enforced."""
    kinds = ("deployments", "services", "configmaps", "secrets", "statefulsets",
             "poddisruptionbudgets", "networkpolicies")
    return any(ref.get("blockOwnerDeletion") and ref.get("kind") == "LLMService"
               for kind in kinds for obj in emu.objects(kind, NS)
               for ref in obj["metadata"].get("ownerReferences", []))


def service() -> dict[str, Any]:
    return {"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"model": {"name": "m", "source": "m"},
                     "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                                 "ttftSeconds": 0.5}},
                     "decode": {"replicas": 1}, "kvStore": {"managed": {}}}}


def _patch(emu: KubeEmulator, spec: dict[str, Any]) -> None:
    client.CustomObjectsApi(emu.api_client()).patch_namespaced_custom_object(
        *CR, "chat", {"spec": spec})


def _child(emu: KubeEmulator, kind: str, name: str) -> dict[str, Any] | None:
    return emu.get(kind, NS, name)


def test_the_operator_uses_exactly_the_verbs_the_chart_grants(
        emu: KubeEmulator, servers: PodServers, monkeypatch: pytest.MonkeyPatch) -> None:
    client.CustomObjectsApi(emu.api_client()).create_namespaced_custom_object(*CR, service())
    with run_operator(emu, module="cleave.operator.handlers", clusterwide=True):
        eventually(lambda: _child(emu, "statefulsets", "chat-redis"))
        # The autoscaler scales the hot prefill role (deployments/scale).
        _, port = servers.add(Profile("prefill", ttft=0.9, tokens_per_scrape=500))
        create_pod(emu, NS, "chat", "prefill", "chat-prefill-a", port)
        eventually(lambda: (_child(emu, "deployments", "chat-prefill") or {})
                   .get("spec", {}).get("replicas") == 2)
        # Every child kind patched: a changed spec, and the policies' peers.
        _patch(emu, {"decode": {"replicas": 1, "engine": {"maxNumSeqs": 8},
                                "podDisruptionBudget": {"maxUnavailable": 2}},
                     "router": {"port": 9000}, "kvStore": {"ttlSeconds": 60,
                                                           "managed": {"memory": "1Gi"}}})
        eventually(lambda: "9000" in json.dumps(_child(emu, "services", "chat-router")))
        monkeypatch.setenv("CLEAVE_METRICS_PEERS", json.dumps([{"podSelector": {}}]))
        eventually(lambda: "podSelector\": {}}" in json.dumps(
            _child(emu, "networkpolicies", "chat-workers")))
        # Pruned: the prefill role, then the managed Redis for an external one.
        _patch(emu, {"prefill": None, "decode": {"autoscaling": None}})
        eventually(lambda: _child(emu, "deployments", "chat-prefill") is None)
        _patch(emu, {"kvStore": {"managed": None,
                                 "external": {"url": "redis://r.infra:6379/0"}}})
        eventually(lambda: all(_child(emu, kind, "chat-redis") is None for kind in (
            "statefulsets", "services", "networkpolicies")))
        eventually(lambda: _child(emu, "poddisruptionbudgets", "chat-prefill") is None)
    calls = used(emu)
    if owner_blocks(emu):
        calls.add(("update", "cleave.dev", "llmservices/finalizers"))
    grants = granted()
    unused, ungranted = sorted(grants - calls), sorted(calls - grants)
    report("rbac_verbs", used=len(calls), granted=len(grants), granted_but_unused=len(unused),
           used_but_not_granted=len(ungranted))
    assert not ungranted, ungranted
    assert not unused, unused
