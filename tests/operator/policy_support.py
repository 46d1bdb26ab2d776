"""Shorthands for calling the pure autoscaling policy in tests."""

from __future__ import annotations

from typing import Any

from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    Decision,
    PolicyConfig,
    RolePolicy,
    RoleSignals,
    ScalingState,
    decide,
)

NOW = 1000.0
PRE = RolePolicy(1, 20, latency_target=1.0)
DEC = RolePolicy(1, 20, latency_target=0.05, kv_watermark=0.8)


def one(policy: RolePolicy, sig: RoleSignals, state: ScalingState | None = None,
        role: str = PREFILL, **cfg: Any) -> Decision:
    decisions, _ = decide(NOW, {role: sig}, PolicyConfig({role: policy}, **cfg),
                          state or ScalingState())
    return decisions[0]


def two(pre: RoleSignals, dec: RoleSignals, pre_p: RolePolicy = PRE, dec_p: RolePolicy = DEC,
        **cfg: Any) -> dict[str, Decision]:
    decisions, _ = decide(NOW, {PREFILL: pre, DECODE: dec},
                          PolicyConfig({PREFILL: pre_p, DECODE: dec_p}, **cfg), ScalingState())
    return {d.role: d for d in decisions}


def hist(*points: tuple[float, int], role: str = PREFILL) -> ScalingState:
    return ScalingState({role: tuple((NOW - age, n) for age, n in points)})
