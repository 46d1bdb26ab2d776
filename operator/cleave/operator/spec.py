"""The LLMService spec as frozen dataclasses: parsed once, defaulted, then trusted.

The CRD schema rejects most bad specs at admission; what it cannot express (or a spec written
before a schema change) fails here with :class:`SpecError`, which the operator reports in the
status as Degraded instead of crash-looping. See docs/llmservice-spec.md for the contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMAGE = "ghcr.io/cleave-dev/cleave-runtime:0.1.0"
AUTOSCALING_MODES = ("Cleave", "External", "Disabled")
DTYPES = ("auto", "bfloat16", "float32", "float16")


class SpecError(ValueError):
    """The spec cannot be honoured; the message goes into the Degraded condition."""


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


@dataclass(frozen=True)
class Engine:
    max_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory: str | None = None


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


@dataclass(frozen=True)
class Role:
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
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


@dataclass(frozen=True)
class KVStore:
    external_url: str | None = None
    password_secret: SecretRef | None = None
    managed_image: str | None = None
    managed_memory: str = "2Gi"
    ttl_seconds: int = 3600

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
    model_name: str
    model_source: str
    dtype: str = "auto"
    model_claim: str | None = None
    image: str = DEFAULT_IMAGE
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


def _int(raw: Mapping[str, Any], key: str, default: int, low: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecError(f"{where}.{key} must be an integer >= {low}, got {value!r}")
    return value


def _role(raw: Any, where: str) -> Role:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} must be an object")
    engine = raw.get("engine") or {}
    scaling = raw.get("autoscaling")
    auto = None
    if scaling is not None:
        lo = _int(scaling, "minReplicas", 1, 0, f"{where}.autoscaling")
        hi = _int(scaling, "maxReplicas", max(lo, 1), 0, f"{where}.autoscaling")
        if lo > hi:
            raise SpecError(f"{where}.autoscaling: minReplicas {lo} > maxReplicas {hi}")
        auto = Autoscaling(lo, hi, scaling.get("ttftSeconds"), scaling.get("tpotSeconds"),
                           scaling.get("kvCacheUsage"),
                           _optional_positive(scaling, "tokensPerSecondPerReplica",
                                              f"{where}.autoscaling"))
    return Role(
        replicas=_int(raw, "replicas", 1, 0, where),
        resources=dict(raw.get("resources") or {}),
        node_selector=dict(raw.get("nodeSelector") or {}),
        tolerations=tuple(raw.get("tolerations") or ()),
        engine=Engine(engine.get("maxBatchedTokens"), engine.get("maxNumSeqs"),
                      engine.get("kvCacheMemory")),
        autoscaling=auto)


def _seconds(raw: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(f"{where}.{key} must be a number > 0, got {value!r}")
    return float(value)


def _optional_positive(raw: Mapping[str, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise SpecError(f"{where}.{key} must be a finite number > 0, got {value!r}")
    return float(value)


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
        low = _optional_positive(ratio, "min", where_ratio)
        high = _optional_positive(ratio, "max", where_ratio)
        if low is None or high is None or low > high:
            raise SpecError(f"{where_ratio} needs 0 < min <= max, got {dict(ratio)!r}")
        bounds = (low, high)
    dry_run = raw.get("dryRun", False)
    if not isinstance(dry_run, bool):  # bool("false") is True: a quoted YAML value would act
        raise SpecError(f"{where}.dryRun must be true or false, got {dry_run!r}")
    interval = _seconds(raw, "intervalSeconds", 15.0, where)
    window = _seconds(raw, "windowSeconds", 60.0, where)
    if window < interval:  # a window must hold two scrapes to have a delta at all
        raise SpecError(f"{where}.windowSeconds {window:g} < intervalSeconds {interval:g}")
    return AutoscalerOptions(
        interval_seconds=interval, window_seconds=window, scale_down_delay_seconds=float(delay),
        dry_run=dry_run, prometheus_url=url, cold_start_seconds=float(cold),
        ratio_bounds=bounds)


def parse_spec(obj: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> LLMServiceSpec:
    """An LLMService object (metadata + spec) -> a validated, defaulted spec.

    The API server's schema normally keeps wrong types out, but objects stored before a schema
    change (or written with validation off) reach us too: any shape the parser cannot read is a
    SpecError, which becomes a Degraded condition instead of a crashing handler."""
    try:
        return _parse_spec(obj, default_image)
    except SpecError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise SpecError(f"spec has a field of the wrong shape ({type(e).__name__}: {e})") from e


def _parse_spec(obj: Mapping[str, Any], default_image: str) -> LLMServiceSpec:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is missing")
    model = spec.get("model") or {}
    if not model.get("name") or not model.get("source"):
        raise SpecError("spec.model needs a name and a non-empty source")
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
        ttl_seconds=_int(store, "ttlSeconds", 3600, 1, "spec.kvStore"))
    router_raw = spec.get("router") or {}
    router = Router(
        replicas=_int(router_raw, "replicas", 1, 1, "spec.router"),
        port=_int(router_raw, "port", 8000, 1, "spec.router"),
        service_type=str(router_raw.get("serviceType", "ClusterIP")),
        disaggregate_min_tokens=_int(router_raw, "disaggregateMinTokens", 64, 0, "spec.router"),
        kv_load_failure_policy=str(router_raw.get("kvLoadFailurePolicy", "recompute")),
        api_key_secret=_secret(router_raw.get("apiKeySecret"), "spec.router.apiKeySecret"))
    scaling = spec.get("autoscaling") or {}
    mode = scaling.get("mode", "Cleave")
    if mode not in AUTOSCALING_MODES:
        raise SpecError(f"spec.autoscaling.mode must be one of {AUTOSCALING_MODES}")
    budget = scaling.get("gpuBudget")
    return LLMServiceSpec(
        name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "default")),
        model_name=str(model["name"]), model_source=str(model["source"]), dtype=str(dtype),
        model_claim=(model.get("volume") or {}).get("claimName"),
        image=str(spec.get("image", default_image)),
        prefill=_role(spec["prefill"], "spec.prefill") if spec.get("prefill") else None,
        decode=_role(spec["decode"], "spec.decode"), router=router, kv_store=kv,
        autoscaling_mode=str(mode),
        gpu_budget=int(budget) if budget is not None else None,
        scale_to_zero=bool(scaling.get("scaleToZero", False)),
        autoscaler=_autoscaler(scaling))
