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

from cleave.operator.spec import LLMServiceSpec, Role

WORKER_PORT = 8100
REDIS_PORT = 6379
GRACE_SECONDS = 30
Manifest = dict[str, Any]


def labels(spec: LLMServiceSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "cleave-operator"}


def _meta(spec: LLMServiceSpec, name: str, component: str, owner: Manifest) -> Manifest:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component),
            "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}]}


def owner_reference(obj: Mapping[str, Any]) -> Manifest:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
            "uid": meta["uid"]}


def redis_url(spec: LLMServiceSpec) -> str:
    if spec.kv_store.external_url is not None:
        return spec.kv_store.external_url
    return f"redis://{spec.name}-redis.{spec.namespace}.svc:{REDIS_PORT}/0"


def _password_env(spec: LLMServiceSpec) -> list[Manifest]:
    ref = spec.kv_store.password_secret
    if spec.kv_store.managed:
        name, key = f"{spec.name}-redis-auth", "password"
    elif ref is not None:
        name, key = ref.name, ref.key
    else:
        return []
    return [{"name": "CLEAVE_REDIS_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]


_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
             "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
             "seccompProfile": {"type": "RuntimeDefault"}}


def _pod(spec: LLMServiceSpec, component: str, container: Manifest, role: Role | None,
         extra_volumes: list[Manifest]) -> Manifest:
    pod: Manifest = {
        "metadata": {"labels": labels(spec, component)},
        "spec": {
            # Workers and the router never call the Kubernetes API: no token in the pod.
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": GRACE_SECONDS + 5,
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}},
                        {"name": "cache", "emptyDir": {}}, *extra_volumes],
        },
    }
    if role is not None:
        if role.node_selector:
            pod["spec"]["nodeSelector"] = dict(role.node_selector)
        if role.tolerations:
            pod["spec"]["tolerations"] = [dict(t) for t in role.tolerations]
    return pod


def _probes(port: int) -> Manifest:
    return {
        "readinessProbe": {"httpGet": {"path": "/ready", "port": port},
                           "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port},
                          "periodSeconds": 10, "failureThreshold": 6},
        # Loading (and, once, converting) a model can take minutes.
        "startupProbe": {"httpGet": {"path": "/health", "port": port},
                         "periodSeconds": 5, "failureThreshold": 120},
    }


def _mounts(spec: LLMServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    mounts: list[Manifest] = [{"name": "tmp", "mountPath": "/tmp"},
                              {"name": "cache", "mountPath": "/cache"}]
    volumes: list[Manifest] = []
    if spec.model_claim:
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": spec.model_claim, "readOnly": True}})
    return mounts, volumes


def _quantities(resources: Mapping[str, Any]) -> Manifest:
    """Quantities as strings: YAML's ``nvidia.com/gpu: 1`` is an int, the API wants a
    quantity (and the client refuses an int)."""
    return {section: {name: str(value) for name, value in (values or {}).items()}
            for section, values in resources.items()}


def worker_deployment(spec: LLMServiceSpec, role_name: str, role: Role, owner: Manifest,
                      replicas: int | None) -> Manifest:
    args = ["worker", "--role", role_name, "--host", "0.0.0.0", "--port", str(WORKER_PORT),
            "--model", spec.model_source, "--dtype", spec.dtype,
            "--redis-url", redis_url(spec), "--namespace", spec.name,
            "--grace-period", str(GRACE_SECONDS)]
    if role.gpus_per_replica:
        args += ["--device", "cuda"]
    if role.engine.max_batched_tokens:
        args += ["--max-batched-tokens", str(role.engine.max_batched_tokens)]
    if role.engine.max_num_seqs:
        args += ["--max-num-seqs", str(role.engine.max_num_seqs)]
    if role.engine.kv_cache_memory:
        args += ["--kv-cache-memory", role.engine.kv_cache_memory]
    mounts, volumes = _mounts(spec)
    container: Manifest = {
        "name": role_name, "image": spec.image, "command": ["cleave"], "args": args,
        "ports": [{"name": "http", "containerPort": WORKER_PORT}],
        "env": [{"name": "CLEAVE_CACHE_DIR", "value": "/cache"}, *_password_env(spec)],
        "resources": _quantities(role.resources), "securityContext": dict(_SECURITY),
        "volumeMounts": mounts, **_probes(WORKER_PORT)}
    component = role_name
    deployment: Manifest = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(spec, f"{spec.name}-{role_name}", component, owner),
        "spec": {"selector": {"matchLabels": labels(spec, component)},
                 "template": _pod(spec, component, container, role, volumes)}}
    if replicas is not None:
        deployment["spec"]["replicas"] = replicas
    return deployment


def worker_service(spec: LLMServiceSpec, role_name: str, owner: Manifest) -> Manifest:
    """Headless: the router resolves it to every ready worker pod of the role."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(spec, f"{spec.name}-{role_name}", role_name, owner),
            "spec": {"clusterIP": "None", "selector": labels(spec, role_name),
                     "ports": [{"name": "http", "port": WORKER_PORT}]}}


ROUTER_HOLD_SECONDS = 600


def router_deployment(spec: LLMServiceSpec, owner: Manifest) -> Manifest:
    r = spec.router
    args = ["router", "--host", "0.0.0.0", "--port", str(r.port), "--model", spec.model_source,
            "--served-model-name", spec.model_name,
            "--disaggregate-min-tokens", str(r.disaggregate_min_tokens),
            "--kv-load-failure-policy", r.kv_load_failure_policy]
    svc = f"{spec.namespace}.svc"
    if spec.prefill is not None:
        args += ["--prefill", f"dns+http://{spec.name}-prefill.{svc}:{WORKER_PORT}"]
    args += ["--decode", f"dns+http://{spec.name}-decode.{svc}:{WORKER_PORT}"]
    args += ["--redis-url", redis_url(spec)]
    if spec.scale_to_zero and spec.autoscaling_mode == "Cleave":
        # With no worker running, the router holds requests (and counts them: the demand that
        # wakes the roles) for as long as a cold start of a GPU pod may take, not a fast 503.
        args += ["--hold-timeout", str(ROUTER_HOLD_SECONDS)]
    env: list[Manifest] = [{"name": "CLEAVE_CACHE_DIR", "value": "/cache"}, *_password_env(spec)]
    if r.api_key_secret is not None:
        env.append({"name": "CLEAVE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": r.api_key_secret.name, "key": r.api_key_secret.key}}})
    mounts, volumes = _mounts(spec)
    container: Manifest = {
        "name": "router", "image": spec.image, "command": ["cleave"], "args": args,
        "ports": [{"name": "http", "containerPort": r.port}], "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        "securityContext": dict(_SECURITY), "volumeMounts": mounts, **_probes(r.port)}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(spec, f"{spec.name}-router", "router", owner),
            "spec": {"replicas": r.replicas,
                     "selector": {"matchLabels": labels(spec, "router")},
                     "template": _pod(spec, "router", container, None, volumes)}}


def router_service(spec: LLMServiceSpec, owner: Manifest) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(spec, f"{spec.name}-router", "router", owner),
            "spec": {"type": spec.router.service_type, "selector": labels(spec, "router"),
                     "ports": [{"name": "http", "port": spec.router.port,
                                "targetPort": spec.router.port}]}}


def endpoint(spec: LLMServiceSpec) -> str:
    return f"http://{spec.name}-router.{spec.namespace}.svc:{spec.router.port}/v1"


def config_map(spec: LLMServiceSpec, owner: Manifest) -> Manifest:
    """The resolved runtime configuration, for humans and tools (the pods take flags)."""
    config = {"model": {"name": spec.model_name, "source": spec.model_source,
                        "dtype": spec.dtype},
              "kvStore": {"url": redis_url(spec), "namespace": spec.name,
                          "ttlSeconds": spec.kv_store.ttl_seconds},
              "router": {"port": spec.router.port,
                         "disaggregateMinTokens": spec.router.disaggregate_min_tokens,
                         "kvLoadFailurePolicy": spec.router.kv_load_failure_policy},
              "autoscaling": {"mode": spec.autoscaling_mode}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(spec, f"{spec.name}-config", "config", owner),
            "data": {"config.json": json.dumps(config, indent=2, sort_keys=True)}}


def managed_redis(spec: LLMServiceSpec, owner: Manifest, password: str) -> list[Manifest]:
    """StatefulSet + Service + the password Secret; the caller generates the password once."""
    name = f"{spec.name}-redis"
    kv = spec.kv_store
    container: Manifest = {
        "name": "redis", "image": kv.managed_image or "redis:7.2",
        "command": ["sh", "-c", 'exec redis-server --requirepass "$REDIS_PASSWORD" '
                    '--save "" --appendonly no --maxmemory-policy allkeys-lru '
                    f'--maxmemory {_redis_bytes(kv.managed_memory)}'],
        "env": [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
            "name": f"{name}-auth", "key": "password"}}}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "resources": {"requests": {"memory": kv.managed_memory},
                      "limits": {"memory": kv.managed_memory}},
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
        "securityContext": {**_SECURITY, "runAsUser": 999},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "data", "mountPath": "/data"}]}
    pod = _pod(spec, "redis", container, None, [{"name": "data", "emptyDir": {}}])
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, f"{name}-auth", "redis",
                                                                  owner),
         "type": "Opaque", "stringData": {"password": password}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, "redis", owner),
         "spec": {"selector": labels(spec, "redis"),
                  "ports": [{"name": "redis", "port": REDIS_PORT}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet",
         "metadata": _meta(spec, name, "redis", owner),
         "spec": {"serviceName": name, "replicas": 1,
                  "selector": {"matchLabels": labels(spec, "redis")}, "template": pod}},
    ]


def _redis_bytes(quantity: str) -> str:
    """Leave Redis 80 % of its memory limit: the rest is its own overhead."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if quantity.endswith(suffix):
            return str(int(float(quantity[: -len(suffix)]) * scale * 0.8))
    return str(int(float(quantity) * 0.8))


def desired_children(spec: LLMServiceSpec, owner: Manifest, redis_password: str,
                     replicas: dict[str, int | None]) -> list[Manifest]:
    """Every child of one LLMService. ``replicas`` maps role -> count (None: not ours)."""
    children = [config_map(spec, owner)]
    if spec.kv_store.managed:
        children += managed_redis(spec, owner, redis_password)
    roles = [("decode", spec.decode)]
    if spec.prefill is not None:
        roles.insert(0, ("prefill", spec.prefill))
    for name, role in roles:
        children.append(worker_deployment(spec, name, role, owner, replicas.get(name)))
        children.append(worker_service(spec, name, owner))
    children += [router_deployment(spec, owner), router_service(spec, owner)]
    return children
