"""The LLMService spec as frozen dataclasses: parsed once, defaulted, then trusted.

The CRD schema rejects most bad specs at admission; what it cannot express (or a spec written
before a schema change) fails here with :class:`SpecError`, which the operator reports in the
status as Degraded instead of crash-looping. See docs/llmservice-spec.md for the contract.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cleave.common.settings import DTYPES
from cleave.operator.spec_values import SpecError as SpecError
from cleave.operator.spec_values import (
    boolean,
    integer,
    no_password_in,
    optional_positive,
    seconds,
    size,
)

DEFAULT_IMAGE = "ghcr.io/cleave-dev/cleave-runtime:0.1.0"
# The CRD's CEL rule on spec.router says the same (crd_schema.py).
UNAUTHENTICATED_LOAD_BALANCER = (
    "spec.router: serviceType LoadBalancer exposes the API beyond the cluster: set "
    "apiKeySecret, or allowUnauthenticated: true if that is meant")
AUTOSCALING_MODES = ("Cleave", "External", "Disabled")
# Children are named <name>-<suffix> and Services must be DNS-1035 labels (<= 63 characters);
# the longest suffix a Service or a StatefulSet's pods get leaves room for 40.
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


@dataclass(frozen=True)
class Engine:
    max_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory: int | None = None  # bytes (the CRD takes a quantity: 256Mi, 2Gi, ...)


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int = 1
    max_replicas: int = 1
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    kv_cache_usage: float | None = None
    # Saturated tok/s of one replica (prompt tokens for prefill, output tokens for decode): the
    # policy's capacity prior, so it can size the role before any rate has been measured.
    tokens_per_second_per_replica: float | None = None


# Pod-spec fields a role (or the router) passes to its pods as written, under the same names.
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
              "priorityClassName", "runtimeClassName")


@dataclass(frozen=True)
class PodOptions:
    """How a role's pods are placed and kept: what Kubernetes users expect to set."""

    fields: Mapping[str, Any] = field(default_factory=dict)  # the POD_FIELDS the spec sets
    startup_seconds: int = 600  # how long loading may take before the pod is restarted
    max_unavailable: int | str = 1  # the role's PodDisruptionBudget


@dataclass(frozen=True)
class Role:
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    pod: PodOptions = PodOptions()
    engine: Engine = Engine()
    autoscaling: Autoscaling | None = None

    @property
    def gpus_per_replica(self) -> int:
        for section in ("limits", "requests"):
            value = (self.resources.get(section) or {}).get("nvidia.com/gpu")
            if value is not None:
                return int(value)
        return 0


@dataclass(frozen=True)
class Router:
    replicas: int = 1
    port: int = 8000
    service_type: str = "ClusterIP"
    disaggregate_min_tokens: int = 64
    kv_load_failure_policy: str = "recompute"
    api_key_secret: SecretRef | None = None
    # A LoadBalancer router without an API key is refused unless this says it is meant.
    allow_unauthenticated: bool = False
    pod: PodOptions = PodOptions()


@dataclass(frozen=True)
class CaRef:
    """Where the CA certificate (PEM) of an external Redis's TLS is: a Secret or ConfigMap
    key in the service's namespace, mounted into the workers and the router."""

    kind: str  # Secret or ConfigMap
    name: str
    key: str


@dataclass(frozen=True)
class RedisTls:
    ca: CaRef | None = None  # None: the image's system CAs
    server_name: str | None = None  # None: the URL's host


@dataclass(frozen=True)
class KVStore:
    external_url: str | None = None
    password_secret: SecretRef | None = None
    managed_image: str | None = None
    managed_memory: str = "2Gi"
    ttl_seconds: int = 3600
    # Mixed into every block hash: only workers with the same salt share blocks. None: the
    # operator keeps a random salt per service in the Secret <name>-kv-salt.
    salt_secret: SecretRef | None = None
    tls: RedisTls = RedisTls()

    @property
    def managed(self) -> bool:
        return self.external_url is None


@dataclass(frozen=True)
class AutoscalerOptions:
    """How the Cleave autoscaler runs (mode Cleave only); what it aims at is per role."""

    interval_seconds: float = 15.0  # one scrape + decision per interval
    window_seconds: float = 60.0  # quantiles and rates cover this much recent history
    scale_down_delay_seconds: float = 300.0  # every recommendation in it must agree to go down
    dry_run: bool = False  # advisory: record decisions, never touch the Deployments
    prometheus_url: str | None = None  # read signals from this server instead of the pods
    cold_start_seconds: float = 0.0  # a new replica's time to ready; > 0 keeps room for rises
    ratio_bounds: tuple[float, float] | None = None  # prefill/decode replicas kept within


@dataclass(frozen=True)
class LLMServiceSpec:
    name: str  # metadata.name: names every child and salts the KV namespace
    namespace: str
    model_name: str  # the first served name: responses and the vllm:* metrics carry it
    model_source: str
    dtype: str = "auto"
    model_claim: str | None = None
    model_revision: str | None = None  # a hub model's branch, tag or commit
    model_aliases: tuple[str, ...] = ()  # more names requests may ask for (spec.model.aliases)
    model_token_secret: SecretRef | None = None  # HF_TOKEN of the pods' download
    image: str = DEFAULT_IMAGE  # spec.image, else the operator's (chart's) runtime image
    gpu_image: str = DEFAULT_IMAGE  # for GPU workers: spec.image, else the chart's CUDA image
    image_pull_secrets: tuple[str, ...] = ()
    prefill: Role | None = None
    decode: Role = Role()
    router: Router = Router()
    kv_store: KVStore = KVStore()
    autoscaling_mode: str = "Cleave"
    gpu_budget: int | None = None
    scale_to_zero: bool = False
    autoscaler: AutoscalerOptions = AutoscalerOptions()

    def autoscaled_roles(self) -> tuple[str, ...]:
        """Roles whose replicas the Cleave autoscaler owns: mode Cleave and an autoscaling
        block. A role without one keeps the replicas the user fixed."""
        if self.autoscaling_mode != "Cleave":
            return ()
        roles = [("prefill", self.prefill), ("decode", self.decode)]
        return tuple(n for n, r in roles if r is not None and r.autoscaling is not None)


def _secret(raw: Any, where: str) -> SecretRef | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not raw.get("name") or not raw.get("key"):
        raise SpecError(f"{where} needs a name and a key")
    return SecretRef(str(raw["name"]), str(raw["key"]))


def _tls(external: Mapping[str, Any]) -> RedisTls:
    raw = external.get("tls")
    if raw is None:
        return RedisTls()
    where = "spec.kvStore.external.tls"
    if not str(external.get("url", "")).startswith("rediss://"):
        raise SpecError(f"{where} needs a rediss:// url")
    refs = [(kind, _secret(raw.get(field), f"{where}.{field}"))
            for kind, field in (("Secret", "caSecret"), ("ConfigMap", "caConfigMap"))
            if raw.get(field) is not None]
    if len(refs) > 1:
        raise SpecError(f"{where} takes caSecret or caConfigMap, not both")
    ca = [CaRef(kind, ref.name, ref.key) for kind, ref in refs if ref is not None]
    server = raw.get("serverName")
    return RedisTls(ca[0] if ca else None, str(server) if server else None)


def _role(raw: Any, where: str) -> Role:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} must be an object")
    engine = raw.get("engine") or {}
    scaling = raw.get("autoscaling")
    auto = None
    if scaling is not None:
        lo = integer(scaling, "minReplicas", 1, 0, f"{where}.autoscaling")
        hi = integer(scaling, "maxReplicas", max(lo, 1), 0, f"{where}.autoscaling")
        if lo > hi:
            raise SpecError(f"{where}.autoscaling: minReplicas {lo} > maxReplicas {hi}")
        auto = Autoscaling(lo, hi, scaling.get("ttftSeconds"), scaling.get("tpotSeconds"),
                           scaling.get("kvCacheUsage"),
                           optional_positive(scaling, "tokensPerSecondPerReplica",
                                              f"{where}.autoscaling"))
    return Role(
        replicas=integer(raw, "replicas", 1, 0, where),
        resources=dict(raw.get("resources") or {}), pod=_pod_options(raw, where),
        engine=Engine(engine.get("maxBatchedTokens"), engine.get("maxNumSeqs"),
                      size(engine.get("kvCacheMemory"), f"{where}.engine.kvCacheMemory")),
        autoscaling=auto)


def _pod_options(raw: Mapping[str, Any], where: str) -> PodOptions:
    budget = raw.get("podDisruptionBudget") or {}
    unavailable = budget.get("maxUnavailable", 1)
    if isinstance(unavailable, bool) or not isinstance(unavailable, int | str):
        raise SpecError(f"{where}.podDisruptionBudget.maxUnavailable must be a count or a "
                        f"percentage, got {unavailable!r}")
    return PodOptions(fields={k: raw[k] for k in POD_FIELDS if raw.get(k) not in (None, "")},
                      startup_seconds=integer(raw, "startupTimeoutSeconds", 600, 10, where),
                      max_unavailable=unavailable)


def _autoscaler(raw: Mapping[str, Any]) -> AutoscalerOptions:
    where = "spec.autoscaling"
    delay = raw.get("scaleDownDelaySeconds", 300)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
        raise SpecError(f"{where}.scaleDownDelaySeconds must be a number >= 0, got {delay!r}")
    prometheus = raw.get("prometheus")
    url = None
    if prometheus is not None:
        if not isinstance(prometheus, Mapping) or not str(prometheus.get("url", "")).startswith(
                ("http://", "https://")):
            raise SpecError(f"{where}.prometheus needs an http(s) url")
        url = str(prometheus["url"])
    cold = raw.get("coldStartSeconds", 0)
    if isinstance(cold, bool) or not isinstance(cold, int | float) or not 0 <= cold < math.inf:
        raise SpecError(f"{where}.coldStartSeconds must be a finite number >= 0, got {cold!r}")
    ratio = raw.get("prefillDecodeRatio")
    bounds = None
    if ratio is not None:
        if not isinstance(ratio, Mapping):
            raise SpecError(f"{where}.prefillDecodeRatio must be an object with min and max")
        where_ratio = f"{where}.prefillDecodeRatio"
        low = optional_positive(ratio, "min", where_ratio)
        high = optional_positive(ratio, "max", where_ratio)
        if low is None or high is None or low > high:
            raise SpecError(f"{where_ratio} needs 0 < min <= max, got {dict(ratio)!r}")
        bounds = (low, high)
    dry_run = boolean(raw, "dryRun", where)
    interval = seconds(raw, "intervalSeconds", 15.0, where)
    window = seconds(raw, "windowSeconds", 60.0, where)
    if window < interval:  # a window must hold two scrapes to have a delta at all
        raise SpecError(f"{where}.windowSeconds {window:g} < intervalSeconds {interval:g}")
    return AutoscalerOptions(
        interval_seconds=interval, window_seconds=window, scale_down_delay_seconds=float(delay),
        dry_run=dry_run, prometheus_url=url, cold_start_seconds=float(cold),
        ratio_bounds=bounds)


def parse_spec(obj: Mapping[str, Any], default_image: str = DEFAULT_IMAGE,
               default_gpu_image: str = "") -> LLMServiceSpec:
    """An LLMService object (metadata + spec) -> a validated, defaulted spec.

    The API server's schema normally keeps wrong types out, but objects stored before a schema
    change (or written with validation off) reach us too: any shape the parser cannot read is a
    SpecError, which becomes a Degraded condition instead of a crashing handler."""
    try:
        return _parse_spec(obj, default_image, default_gpu_image or default_image)
    except SpecError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise SpecError(f"spec has a field of the wrong shape ({type(e).__name__}: {e})") from e


def _parse_spec(obj: Mapping[str, Any], default_image: str, default_gpu_image: str,
                ) -> LLMServiceSpec:
    meta = obj.get("metadata") or {}
    name = str(meta.get("name", ""))
    if not NAME_RE.match(name) or len(name) > MAX_NAME:
        raise SpecError(f"metadata.name {name!r} must be at most {MAX_NAME} lowercase letters, "
                        "digits and '-', starting with a letter and ending with a letter or "
                        "digit: it names the service's Services and pods")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is missing")
    model = spec.get("model") or {}
    if not model.get("name") or not model.get("source"):
        raise SpecError("spec.model needs a name and a non-empty source")
    aliases = model.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise SpecError("spec.model.aliases must be a list of non-empty names")
    dtype = model.get("dtype", "auto")
    if dtype not in DTYPES:
        raise SpecError(f"spec.model.dtype must be one of {DTYPES}, got {dtype!r}")
    if "decode" not in spec:
        raise SpecError("spec.decode is required")
    store = spec.get("kvStore") or {}
    external, managed = store.get("external"), store.get("managed")
    if (external is None) == (managed is None):
        raise SpecError("spec.kvStore needs exactly one of external or managed")
    kv = KVStore(
        external_url=str(external["url"]) if external else None,
        password_secret=_secret((external or {}).get("passwordSecret"),
                                "spec.kvStore.external.passwordSecret"),
        managed_image=str((managed or {}).get("image", "redis:7.2")) if managed else None,
        managed_memory=str((managed or {}).get("memory", "2Gi")),
        ttl_seconds=integer(store, "ttlSeconds", 3600, 1, "spec.kvStore"),
        salt_secret=_secret(store.get("saltSecret"), "spec.kvStore.saltSecret"),
        tls=_tls(external or {}))
    if kv.managed:
        size(kv.managed_memory, "spec.kvStore.managed.memory")
    elif kv.external_url is not None:
        no_password_in(kv.external_url, "spec.kvStore.external.url")
    router_raw = spec.get("router") or {}
    router = Router(
        replicas=integer(router_raw, "replicas", 1, 1, "spec.router"),
        port=integer(router_raw, "port", 8000, 1, "spec.router"),
        service_type=str(router_raw.get("serviceType", "ClusterIP")),
        disaggregate_min_tokens=integer(router_raw, "disaggregateMinTokens", 64, 0, "spec.router"),
        kv_load_failure_policy=str(router_raw.get("kvLoadFailurePolicy", "recompute")),
        api_key_secret=_secret(router_raw.get("apiKeySecret"), "spec.router.apiKeySecret"),
        allow_unauthenticated=boolean(router_raw, "allowUnauthenticated", "spec.router"),
        pod=_pod_options(router_raw, "spec.router"))
    if router.service_type == "LoadBalancer" and router.api_key_secret is None \
            and not router.allow_unauthenticated:
        raise SpecError(UNAUTHENTICATED_LOAD_BALANCER)
    scaling = spec.get("autoscaling") or {}
    mode = scaling.get("mode", "Cleave")
    if mode not in AUTOSCALING_MODES:
        raise SpecError(f"spec.autoscaling.mode must be one of {AUTOSCALING_MODES}")
    budget = scaling.get("gpuBudget")
    return LLMServiceSpec(
        name=name, namespace=str(meta.get("namespace", "default")),
        model_name=str(model["name"]), model_source=str(model["source"]), dtype=str(dtype),
        model_claim=(model.get("volume") or {}).get("claimName"),
        model_revision=str(model["revision"]) if model.get("revision") else None,
        model_aliases=tuple(aliases),
        model_token_secret=_secret(model.get("tokenSecret"), "spec.model.tokenSecret"),
        image=str(spec.get("image") or default_image),
        gpu_image=str(spec.get("image") or default_gpu_image),
        image_pull_secrets=tuple(str(ref["name"]) for ref in spec.get("imagePullSecrets") or ()),
        prefill=_role(spec["prefill"], "spec.prefill") if spec.get("prefill") else None,
        decode=_role(spec["decode"], "spec.decode"), router=router, kv_store=kv,
        autoscaling_mode=str(mode),
        gpu_budget=int(budget) if budget is not None else None,
        scale_to_zero=boolean(scaling, "scaleToZero", "spec.autoscaling"),
        autoscaler=_autoscaler(scaling))
