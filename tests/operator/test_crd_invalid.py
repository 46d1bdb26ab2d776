"""Invalid LLMService objects are rejected by the CRD's schema and CEL rules, valid edges pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crd_validation import (
    minimal,
    validate,
    with_spec,
)

# --- invalid specs ------------------------------------------------------------------------

INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "min > max": (
        with_spec(decode__autoscaling={"minReplicas": 5, "maxReplicas": 2}),
        "spec.decode.autoscaling: decode.autoscaling.minReplicas must be <= maxReplicas"),
    "prefill min > max": (
        with_spec(prefill__autoscaling={"minReplicas": 3, "maxReplicas": 1}),
        "spec.prefill.autoscaling: prefill.autoscaling.minReplicas must be <= maxReplicas"),
    "both external and managed": (
        with_spec(kvStore={"managed": {}, "external": {"url": "redis://r:6379/0"}}),
        "spec.kvStore: kvStore must set exactly one of external or managed"),
    "neither external nor managed": (
        with_spec(kvStore={"ttlSeconds": 60}),
        "spec.kvStore: kvStore must set exactly one of external or managed"),
    "empty source": (
        with_spec(model__source=""),
        "spec.model.source: model.source must not be empty"),
    "negative replicas": (
        with_spec(decode__replicas=-1),
        "spec.decode.replicas: -1 is less than the minimum of 0"),
    "aliases not a list": (
        with_spec(model__aliases="tiny"),
        "spec.model.aliases: 'tiny' is not of type 'array'"),
    "empty alias": (
        with_spec(model__aliases=["tiny", ""]),
        "spec.model.aliases[1]: '' should be non-empty"),
    "bad dtype": (
        with_spec(model__dtype="int4"),
        "spec.model.dtype: 'int4' is not one of ['auto', 'bfloat16', 'float32', 'float16']"),
    "tpotSeconds 0": (
        with_spec(decode__autoscaling={"tpotSeconds": 0}),
        "spec.decode.autoscaling.tpotSeconds: 0 is less than or equal to the minimum of 0"),
    "ttftSeconds negative": (
        with_spec(prefill__autoscaling={"ttftSeconds": -0.5}),
        "spec.prefill.autoscaling.ttftSeconds: -0.5 is less than or equal to the minimum of 0"),
    "kvCacheUsage 1.5": (
        with_spec(decode__autoscaling={"kvCacheUsage": 1.5}),
        "spec.decode.autoscaling.kvCacheUsage: 1.5 is greater than the maximum of 1"),
    "minReplicas 0 without scaleToZero": (
        with_spec(decode__autoscaling={"minReplicas": 0, "maxReplicas": 2}),
        "spec: autoscaling minReplicas must be >= 1 unless autoscaling.scaleToZero is true"),
    "prefill minReplicas 0 with scaleToZero false": (
        with_spec(prefill__autoscaling={"minReplicas": 0}, autoscaling={"scaleToZero": False}),
        "spec: autoscaling minReplicas must be >= 1 unless autoscaling.scaleToZero is true"),
    "unknown kvLoadFailurePolicy": (
        with_spec(router__kvLoadFailurePolicy="retry"),
        "spec.router.kvLoadFailurePolicy: 'retry' is not one of ['recompute', 'fail']"),
    "port 70000": (
        with_spec(router__port=70000),
        "spec.router.port: 70000 is greater than the maximum of 65535"),
    "router replicas 0": (
        with_spec(router__replicas=0),
        "spec.router.replicas: 0 is less than the minimum of 1"),
    "ttlSeconds 0": (
        with_spec(kvStore__ttlSeconds=0),
        "spec.kvStore.ttlSeconds: 0 is less than the minimum of 1"),
    "bad mode": (
        with_spec(autoscaling={"mode": "HPA"}),
        "spec.autoscaling.mode: 'HPA' is not one of ['Cleave', 'External', 'Disabled']"),
    "window shorter than the interval": (
        with_spec(autoscaling={"intervalSeconds": 30, "windowSeconds": 10}),
        "spec.autoscaling: autoscaling.windowSeconds must be >= intervalSeconds"),
    "interval under a second": (
        with_spec(autoscaling={"intervalSeconds": 0.5}),
        "spec.autoscaling.intervalSeconds: 0.5 is less than the minimum of 1"),
    "negative scale-down delay": (
        with_spec(autoscaling={"scaleDownDelaySeconds": -1}),
        "spec.autoscaling.scaleDownDelaySeconds: -1 is less than the minimum of 0"),
    "coldStartSeconds negative": (
        with_spec(autoscaling={"coldStartSeconds": -1}),
        "spec.autoscaling.coldStartSeconds: -1 is less than the minimum of 0"),
    "coldStartSeconds a string": (
        with_spec(autoscaling={"coldStartSeconds": "90s"}),
        "spec.autoscaling.coldStartSeconds: '90s' is not of type 'number'"),
    "prefill tokensPerSecondPerReplica 0": (
        with_spec(prefill__autoscaling={"tokensPerSecondPerReplica": 0}),
        "spec.prefill.autoscaling.tokensPerSecondPerReplica: 0 is less than or equal to the "
        "minimum of 0"),
    "decode tokensPerSecondPerReplica negative": (
        with_spec(decode__autoscaling={"tokensPerSecondPerReplica": -5}),
        "spec.decode.autoscaling.tokensPerSecondPerReplica: -5 is less than or equal to the "
        "minimum of 0"),
    "decode tokensPerSecondPerReplica a string": (
        with_spec(decode__autoscaling={"tokensPerSecondPerReplica": "1k"}),
        "spec.decode.autoscaling.tokensPerSecondPerReplica: '1k' is not of type 'number'"),
    "tokensPerSecondPerReplica at the spec level": (
        with_spec(autoscaling={"tokensPerSecondPerReplica": 100}),
        "spec.autoscaling: Additional properties are not allowed"),
    "prometheus without a url": (
        with_spec(autoscaling={"prometheus": {}}),
        "spec.autoscaling.prometheus: 'url' is a required property"),
    "prometheus url not http": (
        with_spec(autoscaling={"prometheus": {"url": "prom:9090"}}),
        "spec.autoscaling.prometheus.url: 'prom:9090' does not match"),
    "dryRun not a bool": (
        with_spec(autoscaling={"dryRun": "yes"}),
        "spec.autoscaling.dryRun: 'yes' is not of type 'boolean'"),
    "negative gpuBudget": (
        with_spec(autoscaling={"gpuBudget": -1}),
        "spec.autoscaling.gpuBudget: -1 is less than the minimum of 0"),
    "bad quantity": (
        with_spec(decode__resources={"limits": {"memory": "lots"}}),
        "spec.decode.resources.limits.memory: 'lots' does not match"),
    "missing model": (
        with_spec(model=None),
        "spec: 'model' is a required property"),
    "missing model name": (
        with_spec(model={"source": "x"}),
        "spec.model: 'name' is a required property"),
    "missing decode": (
        with_spec(decode=None),
        "spec: 'decode' is a required property"),
    "missing kvStore": (
        with_spec(kvStore=None),
        "spec: 'kvStore' is a required property"),
    "unknown field": (
        with_spec(decode__replica=2),
        "spec.decode: Additional properties are not allowed ('replica' was unexpected)"),
    "bad toleration operator": (
        with_spec(decode__tolerations=[{"key": "k", "operator": "Maybe"}]),
        "spec.decode.tolerations[0].operator: 'Maybe' is not one of ['Exists', 'Equal']"),
}


@pytest.mark.parametrize(("obj", "message"), list(INVALID.values()), ids=list(INVALID))
def test_invalid_spec_is_rejected(obj: dict[str, Any], message: str) -> None:
    errors = validate(obj)
    assert any(e.startswith(message) for e in errors), errors


def test_minimal_spec_is_valid() -> None:
    assert validate(minimal()) == []


def test_a_model_may_have_aliases_and_a_single_name_stays_valid() -> None:
    assert validate(with_spec(model__aliases=["tiny", "tiny-latest"])) == []
    assert "aliases" not in minimal()["spec"]["model"]  # the single name alone: still valid


def test_scale_to_zero_allows_min_replicas_zero() -> None:
    obj = with_spec(decode__autoscaling={"minReplicas": 0, "maxReplicas": 4},
                    prefill__autoscaling={"minReplicas": 0, "maxReplicas": 2},
                    autoscaling={"scaleToZero": True})
    assert validate(obj) == []


def test_decode_only_and_edge_values_are_valid() -> None:
    obj = with_spec(prefill__replicas=0, router__port=65535, router__disaggregateMinTokens=0,
                    decode__autoscaling={"minReplicas": 2, "maxReplicas": 2,
                                         "kvCacheUsage": 1, "tpotSeconds": 0.001},
                    decode__resources={"limits": {"nvidia.com/gpu": 1, "cpu": "500m"}},
                    autoscaling={"gpuBudget": 0, "mode": "External"})
    assert validate(obj) == []


def test_validate_does_not_mutate_its_input() -> None:
    obj = minimal()
    before = copy.deepcopy(obj)
    validate(obj)
    assert obj == before
