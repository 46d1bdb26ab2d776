"""Desired state: pure functions from an LLMService spec to the manifests of its children.

No I/O and no clock: the same spec always builds the same objects, so reconciliation is a
diff against what exists, and every rule here is unit-tested directly. ``replicas=None``
leaves a Deployment's replicas out entirely, for roles whose replicas someone else owns (the
Cleave autoscaler, or in autoscaling mode ``External`` an HPA or KEDA).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cleave.common.model_source import looks_like_hub_id
from cleave.common.quantity import parse_bytes
from cleave.common.settings import (
    API_KEY_ENV,
    KV_SALT_ENV,
    REDIS_PASSWORD_ENV,
    WORKER_PORT,
    DownloadSettings,
    EngineSettings,
    RedisSettings,
    RouterSettings,
    RoutingSettings,
    ServedSettings,
    StoreSettings,
    WorkerSettings,
)
from cleave.operator import credentials, redis_users, security
from cleave.operator import pod_template as pods
from cleave.operator.pod_template import GRACE_SECONDS, SECURITY, Manifest, labels
from cleave.operator.redis_users import REDIS_PORT
from cleave.operator.spec import LLMServiceSpec, Role

__all__ = ["labels"]  # re-exported: reconcile and the autoscaler select a role's pods by them


def owner_reference(obj: Mapping[str, Any]) -> Manifest:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
            "uid": meta["uid"]}


def redis_url(spec: LLMServiceSpec, component: str = "decode") -> str:
    """The store's URL as ``component`` reaches it: the managed Redis as its own ACL user."""
    if spec.kv_store.external_url is not None:
        return spec.kv_store.external_url
    user = redis_users.user_of(component)[0]
    return f"redis://{user}@{spec.name}-redis.{spec.namespace}.svc:{REDIS_PORT}/0"


def redis_settings(spec: LLMServiceSpec, component: str) -> RedisSettings:
    """How ``component`` reaches the store: its URL (and user), the mounted CA, if any."""
    tls = spec.kv_store.tls
    return RedisSettings(redis_url=redis_url(spec, component),
                         redis_tls_ca_file=pods.REDIS_CA_FILE if tls.ca else None,
                         redis_tls_server_name=tls.server_name)


def _password_env(spec: LLMServiceSpec, component: str) -> list[Manifest]:
    ref = spec.kv_store.password_secret
    if spec.kv_store.managed:  # only its own user's password: separate keys of one Secret
        ref = redis_users.password_ref(spec, component)
    return [credentials.env(REDIS_PASSWORD_ENV, ref)] if ref is not None else []


SALT_KEY = credentials.KV_SALT.keys[0]


def _salt_env(spec: LLMServiceSpec) -> Manifest:
    return credentials.env(KV_SALT_ENV, spec.kv_store.salt_secret
                           or credentials.KV_SALT.ref(spec, SALT_KEY))


def kv_namespace(spec: LLMServiceSpec) -> str:
    """The service's KV namespace: its Kubernetes namespace and name, so that two services
    named alike in two namespaces share no blocks on one Redis, and one's cleanup (every key
    of its namespace) cannot wipe the other's."""
    return f"{spec.namespace}.{spec.name}"


def worker_settings(spec: LLMServiceSpec, role_name: str, role: Role) -> WorkerSettings:
    engine = role.engine
    defaults = EngineSettings()
    return WorkerSettings(
        role=role_name, host="0.0.0.0", port=WORKER_PORT, grace_period=GRACE_SECONDS,
        # The vllm:* metrics' model_name, as the router's: the first name only, so that a
        # changed alias rolls the router alone, not every worker.
        served=ServedSettings((spec.model_name,)),
        store=StoreSettings(redis=redis_settings(spec, role_name), namespace=kv_namespace(spec),
                            kv_ttl_seconds=spec.kv_store.ttl_seconds),
        engine=EngineSettings(
            model=spec.model_source, revision=spec.model_revision, dtype=spec.dtype,
            device="cuda" if role.gpus_per_replica else "auto",
            kv_cache_memory=engine.kv_cache_memory,
            max_num_seqs=engine.max_num_seqs or defaults.max_num_seqs,
            max_batched_tokens=engine.max_batched_tokens or defaults.max_batched_tokens,
            # one rank per GPU the role's pods get
            tensor_parallel_size=max(1, role.gpus_per_replica)))


def download_init(spec: LLMServiceSpec, image: str, mounts: list[Manifest]) -> Manifest | None:
    """For a hub model: an init container that downloads it into the pod's /cache, so that a
    long download never counts against the server's startup probe. Only it holds the token;
    the server then starts offline (:func:`offline_env`) from exactly what it fetched."""
    if not looks_like_hub_id(spec.model_source):
        return None
    env: list[Manifest] = [{"name": "CLEAVE_CACHE_DIR", "value": "/cache"}]
    if spec.model_token_secret is not None:
        env.append(credentials.env("HF_TOKEN", spec.model_token_secret))
    settings = DownloadSettings(model=spec.model_source, revision=spec.model_revision)
    return {"name": "download-model", "image": image, "command": ["cleave"],
            "args": ["download", *settings.to_args()], "env": env,
            "securityContext": dict(SECURITY), "volumeMounts": mounts}


def offline_env(spec: LLMServiceSpec) -> list[Manifest]:
    return [{"name": "HF_HUB_OFFLINE", "value": "1"}] \
        if looks_like_hub_id(spec.model_source) else []


def worker_deployment(spec: LLMServiceSpec, role_name: str, role: Role, owner: Manifest,
                      replicas: int | None) -> Manifest:
    mounts, volumes = pods.volumes(spec, gpu=role.gpus_per_replica > 0)
    image = spec.gpu_image if role.gpus_per_replica else spec.image
    container: Manifest = {
        "name": role_name, "image": image,
        "command": ["cleave"],
        "args": ["worker", *worker_settings(spec, role_name, role).to_args()],
        "ports": [{"name": "http", "containerPort": WORKER_PORT}],
        "env": [{"name": "CLEAVE_CACHE_DIR", "value": "/cache"}, *_password_env(spec, role_name),
                _salt_env(spec), security.internal_token_env(spec), *offline_env(spec)],
        "resources": pods.quantities(role.resources), "securityContext": dict(SECURITY),
        "volumeMounts": mounts, **pods.probes(WORKER_PORT, role.pod.startup_seconds)}
    component = role_name
    deployment: Manifest = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": pods.meta(spec, f"{spec.name}-{role_name}", component, owner),
        "spec": {"selector": {"matchLabels": labels(spec, component)},
                 "template": pods.pod(spec, component, container, role.pod, volumes,
                                      download_init(spec, image, mounts))}}
    if replicas is not None:
        deployment["spec"]["replicas"] = replicas
    return deployment


def worker_service(spec: LLMServiceSpec, role_name: str, owner: Manifest) -> Manifest:
    """Headless: the router resolves it to every ready worker pod of the role."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": pods.meta(spec, f"{spec.name}-{role_name}", role_name, owner),
            "spec": {"clusterIP": "None", "selector": labels(spec, role_name),
                     "ports": [{"name": "http", "port": WORKER_PORT}]}}


ROUTER_HOLD_SECONDS = 600


def router_settings(spec: LLMServiceSpec) -> RouterSettings:
    r = spec.router
    svc = f"{spec.namespace}.svc"
    prefill = f"dns+http://{spec.name}-prefill.{svc}:{WORKER_PORT}"
    hold = None
    if spec.scale_to_zero and spec.autoscaling_mode == "Cleave":
        # With no worker running, the router holds requests (and counts them: the demand that
        # wakes the roles) for as long as a cold start of a GPU pod may take, not a fast 503.
        hold = float(ROUTER_HOLD_SECONDS)
    return RouterSettings(
        model=spec.model_source, revision=spec.model_revision,
        served=ServedSettings((spec.model_name, *spec.model_aliases)), host="0.0.0.0",
        port=r.port, prefill=(prefill,) if spec.prefill is not None else (),
        decode=(f"dns+http://{spec.name}-decode.{svc}:{WORKER_PORT}",),
        redis=redis_settings(spec, "router"),
        routing=RoutingSettings(disaggregate_min_tokens=r.disaggregate_min_tokens,
                                kv_load_failure_policy=r.kv_load_failure_policy,
                                hold_timeout=hold))


def router_deployment(spec: LLMServiceSpec, owner: Manifest,
                      replicas: int | None = None) -> Manifest:
    r = spec.router
    args = ["router", *router_settings(spec).to_args()]
    env: list[Manifest] = [{"name": "CLEAVE_CACHE_DIR", "value": "/cache"},
                           *_password_env(spec, "router"),
                           security.internal_token_env(spec), *offline_env(spec)]
    if r.api_key_secret is not None:
        env.append(credentials.env(API_KEY_ENV, r.api_key_secret))
    mounts, volumes = pods.volumes(spec, gpu=False)
    container: Manifest = {
        "name": "router", "image": spec.image, "command": ["cleave"], "args": args,
        "ports": [{"name": "http", "containerPort": r.port}], "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        "securityContext": dict(SECURITY), "volumeMounts": mounts,
        **pods.probes(r.port, r.pod.startup_seconds)}
    deployment: Manifest = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": pods.meta(spec, f"{spec.name}-router", "router", owner),
        "spec": {"selector": {"matchLabels": labels(spec, "router")},
                 "template": pods.pod(spec, "router", container, r.pod, volumes,
                                      download_init(spec, spec.image, mounts))}}
    if replicas is not None:
        deployment["spec"]["replicas"] = replicas
    return deployment


def router_service(spec: LLMServiceSpec, owner: Manifest) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": pods.meta(spec, f"{spec.name}-router", "router", owner),
            "spec": {"type": spec.router.service_type, "selector": labels(spec, "router"),
                     "ports": [{"name": "http", "port": spec.router.port,
                                "targetPort": spec.router.port}]}}


def endpoint(spec: LLMServiceSpec) -> str:
    return f"http://{spec.name}-router.{spec.namespace}.svc:{spec.router.port}/v1"


def config_map(spec: LLMServiceSpec, owner: Manifest) -> Manifest:
    """The resolved runtime configuration, for humans and tools (the pods take flags)."""
    config = {"model": {"name": spec.model_name, "aliases": list(spec.model_aliases),
                        "source": spec.model_source,
                        "revision": spec.model_revision, "dtype": spec.dtype},
              "kvStore": {"url": redis_url(spec), "namespace": kv_namespace(spec),
                          "ttlSeconds": spec.kv_store.ttl_seconds},
              "router": {"port": spec.router.port,
                         "disaggregateMinTokens": spec.router.disaggregate_min_tokens,
                         "kvLoadFailurePolicy": spec.router.kv_load_failure_policy},
              "autoscaling": {"mode": spec.autoscaling_mode}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": pods.meta(spec, f"{spec.name}-config", "config", owner),
            "data": {"config.json": json.dumps(config, indent=2, sort_keys=True)}}


def managed_redis(spec: LLMServiceSpec, owner: Manifest,
                  passwords: redis_users.RedisPasswords) -> list[Manifest]:
    """StatefulSet + Service + the users' password Secret (redis_users: one ACL user per
    component); the caller generates the passwords once."""
    name = f"{spec.name}-redis"
    kv = spec.kv_store
    options = ['--save ""', "--appendonly no", "--maxmemory-policy allkeys-lru",
               f"--maxmemory {_redis_bytes(kv.managed_memory)}"]
    container: Manifest = {
        "name": "redis", "image": kv.managed_image or "redis:7.2",
        "command": ["sh", "-c", redis_users.server_script(kv_namespace(spec), options)],
        "env": redis_users.server_env(spec),
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": {"requests": {"memory": kv.managed_memory},
                      "limits": {"memory": kv.managed_memory}},
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "securityContext": {**SECURITY, "runAsUser": 999},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "data", "mountPath": "/data"}]}
    pod = pods.pod(spec, "redis", container, None, [{"name": "data", "emptyDir": {}}])
    return [
        redis_users.secret(spec, owner, passwords),
        {"apiVersion": "v1", "kind": "Service", "metadata": pods.meta(spec, name, "redis", owner),
         "spec": {"selector": labels(spec, "redis"),
                  "ports": [{"name": "redis", "port": REDIS_PORT}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": pods.meta(spec, name, "redis", owner),
         "spec": {"serviceName": name, "replicas": 1,
                  "selector": {"matchLabels": labels(spec, "redis")}, "template": pod}},
    ]


def _redis_bytes(quantity: str) -> str:
    """Leave Redis 80 % of its memory limit: the rest is its own overhead."""
    return str(int(parse_bytes(quantity) * 0.8))


def kv_salt_secret(spec: LLMServiceSpec, owner: Manifest, salt: str) -> Manifest:
    """The service's own random KV salt (written once, like the Redis password): two services
    never share blocks by accident, even on one external Redis."""
    return credentials.KV_SALT.secret(spec, owner, {SALT_KEY: salt})


def desired_children(spec: LLMServiceSpec, owner: Manifest,
                     redis_passwords: redis_users.RedisPasswords,
                     replicas: dict[str, int | None], kv_salt: str, *, internal_token: str,
                     access: security.Access = security.OPEN_ACCESS) -> list[Manifest]:
    """Every child of one LLMService. ``replicas`` maps prefill, decode and router to a count
    (None: not ours)."""
    children = [config_map(spec, owner),
                security.internal_token_secret(spec, owner, internal_token),
                *security.network_policies(spec, owner, access)]
    if spec.kv_store.salt_secret is None:
        children.append(kv_salt_secret(spec, owner, kv_salt))
    if spec.kv_store.managed:
        children += managed_redis(spec, owner, redis_passwords)
    roles = [("decode", spec.decode)]
    if spec.prefill is not None:
        roles.insert(0, ("prefill", spec.prefill))
    for name, role in roles:
        children.append(worker_deployment(spec, name, role, owner, replicas.get(name)))
        children.append(worker_service(spec, name, owner))
        children.append(pods.disruption_budget(spec, name, role.pod, owner))
    children += [router_deployment(spec, owner, replicas.get("router")),
                 router_service(spec, owner),
                 pods.disruption_budget(spec, "router", spec.router.pod, owner)]
    return children
