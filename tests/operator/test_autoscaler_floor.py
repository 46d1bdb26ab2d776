"""The one-worker floor as the policy decides it (policy.decide keeps it in its state, so the
operator, cleave up and the simulator all get it): pure decisions given signals."""

from __future__ import annotations

from cleave.autoscaling.flips import BOTH, WorkerView, plan_flips
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    FloorPolicy,
    PolicyConfig,
    RolePolicy,
    RoleSignals,
    ScalingState,
    decide,
)

# Capacity per replica: 6,000 prompt tok/s, 5,000 output tok/s (the priors).
ROLES = {PREFILL: RolePolicy(1, 4, latency_target=1.0, prior_throughput=6000.0),
         DECODE: RolePolicy(1, 4, latency_target=0.04, prior_throughput=5000.0)}
FLOOR = PolicyConfig(ROLES, floor=FloorPolicy(utilization=0.3, hold_s=300.0))


def signals(prompt_rate: float | None, output_rate: float | None,
            ready: int = 1) -> dict[str, RoleSignals]:
    return {PREFILL: RoleSignals(latency_p90=0.3, queue_depth=0.0, token_rate=prompt_rate,
                                 ready=ready),
            DECODE: RoleSignals(latency_p90=0.02, queue_depth=0.0, token_rate=output_rate,
                                ready=ready)}


def run(cfg: PolicyConfig, steps: list[tuple[float, dict[str, RoleSignals]]]) -> list[bool]:
    state, out = ScalingState(), []
    for now, sig in steps:
        _, state = decide(now, sig, cfg, state)
        out.append(state.colocate)
    return out


def test_low_load_takes_the_floor_after_the_hold_and_leaves_it_at_once() -> None:
    low = signals(600.0, 500.0)  # 0.1 + 0.1 of a worker: fits 0.3
    busy = signals(1500.0, 1000.0)  # 0.25 + 0.2 = 0.45: two workers
    got = run(FLOOR, [(0.0, low), (150.0, low), (300.0, low), (315.0, busy), (330.0, low)])
    assert got == [False, False, True, False, False]  # the clock restarts after leaving


def test_unknown_demand_keeps_the_clock_and_a_role_wanting_two_leaves() -> None:
    low, unknown = signals(600.0, 500.0), signals(None, 500.0)
    assert run(FLOOR, [(0.0, low), (200.0, unknown), (300.0, low)]) == [False, False, True]
    # Prefill's latency at 3 x its target asks for a second prefill worker: no floor, however
    # low the token rates read.
    slow = signals(600.0, 500.0, ready=1)
    slow[PREFILL] = RoleSignals(latency_p90=3.0, queue_depth=9.0, token_rate=600.0, ready=1)
    assert run(FLOOR, [(0.0, low), (300.0, low), (315.0, slow)]) == [False, True, False]


def test_without_a_floor_or_a_capacity_per_replica_there_is_none() -> None:
    low = signals(600.0, 500.0)
    assert run(PolicyConfig(ROLES), [(0.0, low), (400.0, low)]) == [False, False]
    # No prior and nothing measured: load cannot be compared to a worker, so no floor.
    blind = {r: RolePolicy(1, 4, latency_target=p.latency_target) for r, p in ROLES.items()}
    cfg = PolicyConfig(blind, floor=FloorPolicy(hold_s=0.0))
    assert run(cfg, [(0.0, low), (400.0, low)]) == [False, False]
    # A measured rate stands in for the prior.
    measured = {r: RoleSignals(**{**vars(s), "throughput_per_replica": 5000.0})
                for r, s in low.items()}
    assert run(cfg, [(0.0, measured)]) == [True]


def test_the_decision_is_carried_out_by_the_flip_planner() -> None:
    _, state = decide(0.0, signals(600.0, 500.0), PolicyConfig(
        ROLES, floor=FloorPolicy(hold_s=0.0)), ScalingState())
    workers = [WorkerView("p1", PREFILL, PREFILL, True, 1.0),
               WorkerView("d1", DECODE, DECODE, True, 3.0)]
    plan = plan_flips({PREFILL: 1, DECODE: 1}, workers, state.colocate)
    assert plan.flips == (("d1", BOTH),) and plan.remove == ("p1",)
    assert plan.replicas == {PREFILL: 0, DECODE: 1}
