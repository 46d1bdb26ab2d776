"""Who may reach what inside one LLMService: its internal token and its NetworkPolicies.

Pure builders, like ``builders``. Two layers, each enough alone against a pod that merely
reaches a port: the token (every ``/internal/*`` call to a worker carries it; see
runtime/cleave/runtime/serving/internal_auth.py), and the policies (only the service's router
and the operator reach its workers; only its workers and router reach its managed Redis). A
cluster without a NetworkPolicy engine ignores the policies; the token still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.common.settings import INTERNAL_TOKEN_ENV, WORKER_PORT
from cleave.operator import credentials
from cleave.operator.metadata import COMPONENT, Manifest, meta, service_labels
from cleave.operator.redis_users import REDIS_PORT
from cleave.operator.spec import LLMServiceSpec

# The chart labels the operator pod so (charts/cleave/templates/_helpers.tpl), and gives it
# its namespace in POD_NAMESPACE: the policies let it reach the workers (role flips, scrapes).
OPERATOR_LABELS = {COMPONENT: "operator", "app.kubernetes.io/part-of": "cleave"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


TOKEN_KEY = credentials.INTERNAL_TOKEN.keys[0]


def internal_token_secret_name(spec: LLMServiceSpec) -> str:
    return credentials.INTERNAL_TOKEN.name(spec)


def internal_token_secret(spec: LLMServiceSpec, owner: Manifest, token: str) -> Manifest:
    """The service's key of its workers' internal API, generated once by the operator."""
    return credentials.INTERNAL_TOKEN.secret(spec, owner, {TOKEN_KEY: token})


def internal_token_env(spec: LLMServiceSpec) -> Manifest:
    return credentials.env(INTERNAL_TOKEN_ENV, credentials.INTERNAL_TOKEN.ref(spec, TOKEN_KEY))


def _pods_of(spec: LLMServiceSpec, *components: str) -> Manifest:
    """A selector of this service's pods of the given components (same namespace)."""
    return {"matchLabels": service_labels(spec),
            "matchExpressions": [{"key": COMPONENT, "operator": "In",
                                  "values": list(components)}]}


@dataclass(frozen=True)
class Access:
    """What the policies let in besides the service's own pods: the operator (its namespace,
    POD_NAMESPACE in the chart's pod) and the Prometheus peers the chart's values name."""

    operator_namespace: str | None = None
    metrics_peers: tuple[Manifest, ...] = field(default_factory=tuple)


OPEN_ACCESS = Access()  # no namespace known, no Prometheus peers


def _operator_peer(namespace: str | None) -> Manifest:
    peer: Manifest = {"podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}
    # Outside a pod (tests, a laptop) the operator has no namespace: any namespace's pod so
    # labelled may then come in, still only with the token.
    peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: namespace}} \
        if namespace else {}
    return peer


def _policy(spec: LLMServiceSpec, owner: Manifest, name: str, selected: Manifest,
            port: int, peers: list[Manifest]) -> Manifest:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(spec, f"{spec.name}-{name}", "network-policy", owner),
            "spec": {"podSelector": selected, "policyTypes": ["Ingress"],
                     "ingress": [{"from": peers, "ports": [{"protocol": "TCP",
                                                            "port": port}]}]}}


def network_policies(spec: LLMServiceSpec, owner: Manifest, access: Access) -> list[Manifest]:
    """Workers: ingress from the service's router pods, the operator, and the metrics peers
    (Prometheus; one port serves /metrics and the API, so they get the port, not the key).
    Managed Redis: ingress from the service's workers and router only. Kubelet probes come
    from the node, which NetworkPolicy implementations let through."""
    workers = _pods_of(spec, "prefill", "decode")
    policies = [_policy(spec, owner, "workers", workers, WORKER_PORT,
                        [{"podSelector": _pods_of(spec, "router")},
                         _operator_peer(access.operator_namespace), *access.metrics_peers])]
    if spec.kv_store.managed:
        policies.append(_policy(spec, owner, "redis", _pods_of(spec, "redis"), REDIS_PORT,
                                [{"podSelector": _pods_of(spec, "prefill", "decode",
                                                          "router")}]))
    return policies
