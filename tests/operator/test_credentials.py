"""Every Secret the operator writes and every reference its pods make to a secret key, built by
one mechanism (operator/cleave/operator/credentials.py), for a service with every feature that
takes one: the managed Redis's ACL users, the internal token, the generated KV salt, a hub
model's token and the router's API key; and for one on an external Redis with the user's
password, salt and CA Secrets.

The expected structures below were captured from the builders before they moved onto the one
mechanism (the whole children of both services compared equal, byte for byte, after the move);
the invariants say why they are right: each reference names a key that exists, and each pod
holds only the keys it needs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_builders import build

from cleave.operator import credentials
from cleave.operator.builders import owner_reference
from cleave.operator.spec import parse_spec

META = {"name": "chat", "namespace": "ml", "uid": "u-1"}
FULL: dict[str, Any] = {
    "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService", "metadata": META, "spec": {
        "model": {"name": "smol", "source": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "tokenSecret": {"name": "hf", "key": "token"}},
        "prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        "decode": {"replicas": 3},
        "router": {"apiKeySecret": {"name": "keys", "key": "api"}},
        "kvStore": {"managed": {"memory": "1Gi"}}}}
EXTERNAL: dict[str, Any] = {
    "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService", "metadata": META, "spec": {
        "model": {"name": "smol", "source": "smollm2-135m-instruct"},
        "decode": {"replicas": 1},
        "kvStore": {"external": {"url": "rediss://r.infra:6380/0",
                                 "passwordSecret": {"name": "rs", "key": "pass"},
                                 "tls": {"caSecret": {"name": "ca", "key": "ca.pem"}}},
                    "saltSecret": {"name": "team-salt", "key": "s"}}}}
# Keys of Secrets the user names in the spec: the operator references them, never writes them.
USER_KEYS = {("hf", "token"), ("keys", "api"), ("rs", "pass"), ("team-salt", "s")}
Ref = tuple[str, str, str]  # (variable, Secret, key)


def secret(name: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": name, "namespace": "ml",
        "labels": {"app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": "chat",
                   "app.kubernetes.io/component": component,
                   "app.kubernetes.io/managed-by": "cleave-operator"},
        "ownerReferences": [{"apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
                             "name": "chat", "uid": "u-1", "controller": True,
                             "blockOwnerDeletion": True}]},
        "type": "Opaque", "stringData": data}


def refs(children: dict[str, dict[str, Any]]) -> dict[str, list[Ref]]:
    """Each pod's containers' (init ones too) secret variables, as pod/container."""
    out: dict[str, list[Ref]] = {}
    for name, child in children.items():
        if child["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = child["spec"]["template"]["spec"]
        for container in pod["containers"] + (pod.get("initContainers") or []):
            out[f"{name}/{container['name']}"] = [
                (e["name"], e["valueFrom"]["secretKeyRef"]["name"],
                 e["valueFrom"]["secretKeyRef"]["key"])
                for e in container.get("env", []) if "valueFrom" in e]
    return out


def key_volumes(children: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [v for v in c["spec"]["template"]["spec"]["volumes"]
                   if "secret" in v or "configMap" in v]
            for name, c in children.items() if c["kind"] in ("Deployment", "StatefulSet")}


WORKER = [("CLEAVE_REDIS_PASSWORD", "chat-redis-users", "worker"),
          ("CLEAVE_KV_SALT", "chat-kv-salt", "salt"),
          ("CLEAVE_INTERNAL_TOKEN", "chat-internal-token", "token")]
HF = [("HF_TOKEN", "hf", "token")]


def test_a_full_service_writes_and_references_exactly_the_captured_secrets() -> None:
    children = build(FULL)
    assert {n: c for n, c in children.items() if c["kind"] == "Secret"} == {
        "Secret/chat-internal-token": secret("chat-internal-token", "internal-token",
                                             {"token": "tok"}),
        "Secret/chat-kv-salt": secret("chat-kv-salt", "kv-salt", {"salt": "salt"}),
        "Secret/chat-redis-users": secret("chat-redis-users", "redis",
                                          {"admin": "adm", "worker": "wpw", "router": "rpw"})}
    assert refs(children) == {
        "StatefulSet/chat-redis/redis": [
            ("REDIS_ADMIN_PASSWORD", "chat-redis-users", "admin"),
            ("REDIS_WORKER_PASSWORD", "chat-redis-users", "worker"),
            ("REDIS_ROUTER_PASSWORD", "chat-redis-users", "router")],
        "Deployment/chat-prefill/prefill": WORKER,
        "Deployment/chat-prefill/download-model": HF,
        "Deployment/chat-decode/decode": WORKER,
        "Deployment/chat-decode/download-model": HF,
        "Deployment/chat-router/router": [
            ("CLEAVE_REDIS_PASSWORD", "chat-redis-users", "router"),
            ("CLEAVE_INTERNAL_TOKEN", "chat-internal-token", "token"),
            ("CLEAVE_API_KEY", "keys", "api")],
        "Deployment/chat-router/download-model": HF}
    assert all(v == [] for v in key_volumes(children).values())


@pytest.mark.parametrize("kind, field, volume", [
    ("Secret", "caSecret", {"secret": {"secretName": "ca", "items": [
        {"key": "ca.pem", "path": "ca.crt"}]}}),
    ("ConfigMap", "caConfigMap", {"configMap": {"name": "ca", "items": [
        {"key": "ca.pem", "path": "ca.crt"}]}})])
def test_an_external_store_references_only_the_users_secrets(
        kind: str, field: str, volume: dict[str, Any]) -> None:
    obj = copy.deepcopy(EXTERNAL)
    obj["spec"]["kvStore"]["external"]["tls"] = {field: {"name": "ca", "key": "ca.pem"}}
    children = build(obj)
    assert [n for n, c in children.items() if c["kind"] == "Secret"] == [
        "Secret/chat-internal-token"]
    assert refs(children) == {
        "Deployment/chat-decode/decode": [
            ("CLEAVE_REDIS_PASSWORD", "rs", "pass"), ("CLEAVE_KV_SALT", "team-salt", "s"),
            ("CLEAVE_INTERNAL_TOKEN", "chat-internal-token", "token")],
        "Deployment/chat-router/router": [
            ("CLEAVE_REDIS_PASSWORD", "rs", "pass"),
            ("CLEAVE_INTERNAL_TOKEN", "chat-internal-token", "token")]}
    # Only the CA's one key, as the file the stores read (pod_template.REDIS_CA_FILE).
    assert key_volumes(children) == {"Deployment/chat-decode": [{"name": "redis-ca", **volume}],
                                     "Deployment/chat-router": [{"name": "redis-ca", **volume}]}


@pytest.mark.parametrize("obj", [FULL, EXTERNAL], ids=["full", "external"])
def test_every_reference_names_a_key_that_exists(obj: dict[str, Any]) -> None:
    """A reference to a missing Secret or key keeps the pod from starting: each one names a
    key of a Secret the operator writes, or one the spec names."""
    children = build(obj)
    written = {(c["metadata"]["name"], key) for c in children.values()
               if c["kind"] == "Secret" for key in c["stringData"]}
    taken = {(s, k) for found in refs(children).values() for _, s, k in found}
    assert taken - written <= USER_KEYS, taken - written
    assert written <= taken, f"written but taken by no pod: {written - taken}"


def test_each_pod_holds_only_the_keys_it_needs() -> None:
    """The Redis admin password only in the Redis pod; each other component only its own
    user's password; the hub token only in the download init container, never the servers."""
    by_pod = refs(build(FULL))
    redis_keys = {pod: {k for _, s, k in found if s == "chat-redis-users"}
                  for pod, found in by_pod.items()}
    assert redis_keys.pop("StatefulSet/chat-redis/redis") == {"admin", "worker", "router"}
    assert redis_keys == {
        "Deployment/chat-prefill/prefill": {"worker"}, "Deployment/chat-decode/decode": {"worker"},
        "Deployment/chat-router/router": {"router"},
        **{f"Deployment/chat-{r}/download-model": set() for r in ("prefill", "decode", "router")}}
    for pod, found in by_pod.items():
        assert ("hf" in {s for _, s, _ in found}) == pod.endswith("/download-model"), pod


def test_a_key_a_generated_secret_lacks_is_refused_where_it_is_built() -> None:
    spec = parse_spec(FULL)
    with pytest.raises(KeyError, match="admin"):
        credentials.INTERNAL_TOKEN.ref(spec, "admin")
    with pytest.raises(KeyError, match="salt"):
        credentials.KV_SALT.secret(spec, owner_reference(FULL), {"pepper": "x"})
    assert {g.name(spec) for g in credentials.GENERATED} == {
        "chat-internal-token", "chat-kv-salt", "chat-redis-users"}
