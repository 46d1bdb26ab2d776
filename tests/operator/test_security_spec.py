"""Issue 15's spec rules, as the apiserver applies the CRD (defaults, schema, CEL with celpy:
crd_validation.py) and as the operator parses a spec the CRD did not check: a LoadBalancer
router needs an API key unless unauthenticated access is asked for; an external Redis's TLS
takes a CA from a Secret or a ConfigMap, which reaches the workers and the router (not the
download init container's secrets, not Redis), with a server name, as `cleave` flags."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crd_validation import validate, with_spec
from test_builders import BASE, build, container_of, parsed

from cleave.operator.pod_template import REDIS_CA_FILE
from cleave.operator.spec import SpecError, parse_spec

KEY = {"name": "api", "key": "key"}


@pytest.mark.parametrize(("router", "ok"), [
    ({"serviceType": "LoadBalancer"}, False),
    ({"serviceType": "LoadBalancer", "allowUnauthenticated": False}, False),
    ({"serviceType": "LoadBalancer", "apiKeySecret": KEY}, True),
    ({"serviceType": "LoadBalancer", "allowUnauthenticated": True}, True),
    ({"serviceType": "ClusterIP"}, True), ({}, True), ({"serviceType": "NodePort"}, True)])
def test_a_load_balancer_without_an_api_key_is_refused_unless_allowed(
        router: dict[str, Any], ok: bool) -> None:
    obj = with_spec(router=router)
    errors = validate(obj)
    assert (errors == []) == ok, errors
    if ok:
        parse_spec(obj)
        return
    assert any("LoadBalancer" in e and "apiKeySecret" in e and "allowUnauthenticated" in e
               for e in errors), errors
    with pytest.raises(SpecError, match="allowUnauthenticated"):
        parse_spec(obj)  # a spec stored before the rule existed: Degraded, not served open


CA_SECRET = {"caSecret": {"name": "redis-ca", "key": "ca.pem"}}
CA_MAP = {"caConfigMap": {"name": "redis-ca", "key": "ca.crt"}}


@pytest.mark.parametrize(("url", "tls", "ok"), [
    ("rediss://r.infra:6380/0", CA_SECRET, True),
    ("rediss://r.infra:6380/0", {**CA_MAP, "serverName": "redis.example.com"}, True),
    ("rediss://10.0.0.9:6380/0", {"serverName": "redis.example.com"}, True),
    ("rediss://r.infra:6380/0", {}, True),
    ("redis://r.infra:6379/0", CA_SECRET, False),
    ("rediss://r.infra:6380/0", {**CA_SECRET, **CA_MAP}, False),
    ("rediss://r.infra:6380/0", {"caSecret": {"name": "x"}}, False),
    ("rediss://r.infra:6380/0", {"serverName": ""}, False)])
def test_redis_tls_takes_one_ca_and_needs_rediss(url: str, tls: dict[str, Any],
                                                 ok: bool) -> None:
    obj = with_spec(kvStore={"external": {"url": url, "tls": tls}})
    errors = validate(obj)
    assert (errors == []) == ok, errors
    if ok:
        parse_spec(obj)
    elif ("caSecret" in tls and "caConfigMap" in tls) or url.startswith("redis://"):
        with pytest.raises(SpecError, match="tls"):
            parse_spec(obj)


def _with_tls(tls: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["spec"]["kvStore"] = {"external": {"url": "rediss://10.0.0.9:6380/0", "tls": tls}}
    return obj


@pytest.mark.parametrize(("tls", "source"), [
    (CA_SECRET, {"secret": {"secretName": "redis-ca",
                            "items": [{"key": "ca.pem", "path": "ca.crt"}]}}),
    ({**CA_MAP, "serverName": "redis.example.com"},
     {"configMap": {"name": "redis-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}})])
def test_the_ca_and_server_name_reach_the_workers_and_the_router(
        tls: dict[str, Any], source: dict[str, Any]) -> None:
    children = build(_with_tls(tls))
    for role in ("prefill", "decode", "router"):
        deployment = children[f"Deployment/chat-{role}"]
        pod = deployment["spec"]["template"]["spec"]
        assert {"name": "redis-ca", **source} in pod["volumes"]
        assert {"name": "redis-ca", "mountPath": REDIS_CA_FILE.rsplit("/", 1)[0],
                "readOnly": True} in container_of(deployment)["volumeMounts"]
        settings = parsed(deployment)  # what the real `cleave` CLI reads from the args
        redis = settings.redis if role == "router" else settings.store.redis
        assert redis.redis_url == "rediss://10.0.0.9:6380/0"
        assert redis.redis_tls_ca_file == REDIS_CA_FILE
        assert redis.redis_tls_server_name == tls.get("serverName")


def test_without_tls_nothing_is_mounted_and_no_flag_is_set() -> None:
    children = build(BASE)
    for role in ("prefill", "decode", "router"):
        deployment = children[f"Deployment/chat-{role}"]
        assert not any(v["name"] == "redis-ca"
                       for v in deployment["spec"]["template"]["spec"]["volumes"])
        assert not any("--redis-tls" in a for a in container_of(deployment)["args"])
