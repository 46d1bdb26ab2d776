"""The operator's zero-trust children (issue 15): the internal token reaches the router and
every worker from one Secret, and NetworkPolicies let only the service's own pods (and the
operator, and the chart's Prometheus peers) reach its workers and its managed Redis."""

from __future__ import annotations

import copy
from typing import Any

from test_builders import BASE, build, valid_for_the_apiserver

from cleave.common.settings import INTERNAL_TOKEN_ENV, WORKER_PORT
from cleave.operator.builders import desired_children, owner_reference
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.security import Access
from cleave.operator.spec import parse_spec

PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}

PASSWORDS = RedisPasswords("adm", "wpw", "rpw")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels and In expressions), as the API server reads it."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def pod_labels(children: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name.split("/")[1]: c["spec"]["template"]["metadata"]["labels"]
            for name, c in children.items() if c["kind"] in ("Deployment", "StatefulSet")}


def test_router_and_workers_take_the_internal_token_from_the_services_secret() -> None:
    children = build(BASE)
    secret = children["Secret/chat-internal-token"]
    assert secret["stringData"] == {"token": "tok"}
    for role in ("prefill", "decode", "router"):
        [container] = children[f"Deployment/chat-{role}"]["spec"]["template"]["spec"][
            "containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env[INTERNAL_TOKEN_ENV]["valueFrom"] == {"secretKeyRef": {
            "name": "chat-internal-token", "key": "token"}}
        assert not any(a.split("=")[-1] == "tok" for a in container["args"])  # never a flag


def test_workers_admit_only_the_router_the_operator_and_prometheus() -> None:
    spec = parse_spec(BASE)
    children = {f"{c['kind']}/{c['metadata']['name']}": c for c in desired_children(
        spec, owner_reference(BASE), PASSWORDS, {"prefill": 1, "decode": 1, "router": 1}, "salt",
        internal_token="tok", access=Access("cleave-system", (PROMETHEUS,)))}
    valid_for_the_apiserver(children)
    policy = children["NetworkPolicy/chat-workers"]["spec"]
    labels = pod_labels(children)
    assert {name for name, lab in labels.items() if selects(policy["podSelector"], lab)} == {
        "chat-prefill", "chat-decode"}
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": WORKER_PORT}]
    router, operator, prometheus = rule["from"]
    assert {n for n, lab in labels.items() if selects(router["podSelector"], lab)} == {
        "chat-router"}
    assert "namespaceSelector" not in router  # the service's own namespace only
    assert operator["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "cleave-system"}}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert prometheus == PROMETHEUS


def test_managed_redis_admits_only_the_services_workers_and_router() -> None:
    children = build(BASE)
    policy = children["NetworkPolicy/chat-redis"]["spec"]
    labels = pod_labels(children)
    assert {n for n, lab in labels.items() if selects(policy["podSelector"], lab)} == {
        "chat-redis"}
    [rule] = policy["ingress"]
    [peer] = rule["from"]
    assert {n for n, lab in labels.items() if selects(peer["podSelector"], lab)} == {
        "chat-prefill", "chat-decode", "chat-router"}
    other = copy.deepcopy(BASE)
    other["metadata"]["name"] = "other"
    other_labels = pod_labels(build(other))
    assert not any(selects(peer["podSelector"], lab) for lab in other_labels.values())


def test_external_redis_gets_no_policy_of_ours() -> None:
    obj = copy.deepcopy(BASE)
    obj["spec"]["kvStore"] = {"external": {"url": "redis://cache.infra:6379/0"}}
    children = build(obj)
    assert "NetworkPolicy/chat-redis" not in children
    assert "NetworkPolicy/chat-workers" in children


def test_services_named_alike_in_two_namespaces_share_no_kv_keys() -> None:
    """The KV namespace was the service's name alone: same-named services in two Kubernetes
    namespaces shared blocks on one Redis, and one's cleanup wiped the other's."""
    import fnmatch

    from cleave.kv_store.keys import KeySpace
    from cleave.operator.builders import worker_settings

    spaces = []
    for namespace in ("team-a", "team-b"):
        obj = copy.deepcopy(BASE)
        obj["metadata"]["namespace"] = namespace
        spec = parse_spec(obj)
        assert spec.decode is not None
        kv = worker_settings(spec, "decode", spec.decode).store.namespace
        spaces.append(KeySpace(kv, bytes(32)))
    a, b = spaces
    assert a.namespace != b.namespace
    key_of_b = b.block_key(bytes(32)).decode()
    assert not fnmatch.fnmatchcase(key_of_b, a.namespace_pattern().decode())
