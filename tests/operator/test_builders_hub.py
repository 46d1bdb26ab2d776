"""A hub model on Kubernetes: each worker and router pod downloads it in an init container
into its /cache (the token from spec.model.tokenSecret, in that container only); the servers
then start offline from that cache."""

from __future__ import annotations

import copy
from typing import Any

from cleave.common.cli import build_parser
from cleave.common.settings import DownloadSettings, RouterSettings, WorkerSettings
from cleave.operator.builders import desired_children, owner_reference
from cleave.operator.kube import without_nulls
from cleave.operator.redis_users import RedisPasswords
from cleave.operator.spec import parse_spec

SHA = "0123456789abcdef0123456789abcdef01234567"
HUB: dict[str, Any] = {
    "apiVersion": "cleave.dev/v1alpha1", "kind": "LLMService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
    "spec": {
        "model": {"name": "qwen", "source": "Qwen/Qwen2.5-0.5B-Instruct", "revision": SHA,
                  "tokenSecret": {"name": "hf", "key": "token"}},
        "prefill": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        "decode": {"replicas": 1},
        "kvStore": {"managed": {"memory": "1Gi"}},
    },
}

PASSWORDS = RedisPasswords("adm", "wpw", "rpw")


def pods(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = parse_spec(obj)
    children = desired_children(spec, owner_reference(obj), PASSWORDS,
                                {"prefill": 1, "decode": 1, "router": 1}, "salt",
                                internal_token="tok")
    return {c["metadata"]["name"]: without_nulls(c["spec"]["template"]["spec"])
            for c in children if c["kind"] == "Deployment"}


def env_names(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_every_serving_pod_downloads_the_hub_model_first() -> None:
    built = pods(HUB)
    assert set(built) == {"chat-prefill", "chat-decode", "chat-router"}
    for name, pod in built.items():
        [init] = pod["initContainers"]
        [server] = pod["containers"]
        # The same image as the server (the prefill role's is the CUDA build) and the same
        # /cache volume, which the server then reads.
        assert init["image"] == server["image"], name
        assert {"name": "cache", "mountPath": "/cache"} in init["volumeMounts"]
        assert {"name": "cache", "mountPath": "/cache"} in server["volumeMounts"]
        args = build_parser().parse_args(init["args"])
        assert args.command == "download"
        assert DownloadSettings.from_args(args) == DownloadSettings(
            model="Qwen/Qwen2.5-0.5B-Instruct", revision=SHA)
        assert env_names(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert env_names(init)["CLEAVE_CACHE_DIR"] == "/cache"
        # The server never asks the hub: it loads what its init container fetched, and
        # holds no token.
        assert env_names(server)["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in env_names(server)
        parsed = build_parser().parse_args(server["args"])
        settings_class = {"worker": WorkerSettings, "router": RouterSettings}[parsed.command]
        settings = settings_class.from_args(parsed)
        engine = getattr(settings, "engine", settings)
        assert (engine.model, engine.revision) == ("Qwen/Qwen2.5-0.5B-Instruct", SHA)


def test_a_local_source_has_no_download() -> None:
    local = copy.deepcopy(HUB)
    local["spec"]["model"] = {"name": "m", "source": "/models/m", "volume": {"claimName": "c"}}
    for pod in pods(local).values():
        assert "initContainers" not in pod
        assert "HF_HUB_OFFLINE" not in env_names(pod["containers"][0])
    builtin = copy.deepcopy(HUB)
    builtin["spec"]["model"] = {"name": "m", "source": "smollm2-135m-instruct"}
    assert all("initContainers" not in p for p in pods(builtin).values())


def test_a_public_model_needs_no_token() -> None:
    public = copy.deepcopy(HUB)
    del public["spec"]["model"]["tokenSecret"], public["spec"]["model"]["revision"]
    [init] = pods(public)["chat-decode"]["initContainers"]
    assert "HF_TOKEN" not in env_names(init)
    assert init["args"] == ["download", "--model=Qwen/Qwen2.5-0.5B-Instruct"]
