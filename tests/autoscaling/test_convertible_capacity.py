"""The prefill capacity decode workers lend (convertible workers) in Cleave's capacity model,
in the oracle's timetable, and in how static is sized."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cleave.autoscaling.convertible import ConvertiblePrefill, prefill_replicas
from cleave.autoscaling.costmodel import build_cost_model
from cleave.autoscaling.demand import demand_rise
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    PolicyConfig,
    RolePolicy,
    RoleSignals,
    ScalingState,
    decide,
)
from cleave.autoscaling.scenarios import (
    capacity_estimate,
    cleave_config,
    convertible_prefill,
    oracle_schedule,
    static_lower_bound,
)
from cleave.autoscaling.simulator import SimConfig
from cleave.autoscaling.traces import Request, Trace

CFG = SimConfig(build_cost_model("H200", "70b"), cold_start_s=90.0)
LENDING = ConvertiblePrefill(180, 0.04)  # 4,500 tokens a second through a step's budget


def test_a_decode_worker_lends_its_step_budget_less_its_own_batch() -> None:
    assert LENDING.lent(1, 1000.0) == pytest.approx(3500.0)
    assert LENDING.lent(2, 1000.0) == pytest.approx(8000.0)
    assert LENDING.lent(1, 6000.0) == 0.0  # a full batch lends nothing
    assert LENDING.lent(1, None) == 0.0  # unknown output: nothing is counted on
    assert LENDING.lent(0, 0.0) == 0.0
    with pytest.raises(ValueError):
        ConvertiblePrefill(0, 0.04)


def test_the_lent_capacity_covers_rises_never_the_demand_itself() -> None:
    # 6,000 tok/s at 0.8 utilization on 6,000 tok/s replicas: 1.25, whatever is lent.
    assert prefill_replicas(6000, 0.8, 6000, 6000, 10_000) == pytest.approx(1.25)
    # A rise to 12,000 before a new replica is ready: 2 replicas, or 1.5 with 3,000 lent.
    assert prefill_replicas(6000, 0.8, 12_000, 6000) == pytest.approx(2.0)
    assert prefill_replicas(6000, 0.8, 12_000, 6000, 3000) == pytest.approx(1.5)


def _rising_history(demand: float) -> tuple[tuple[float, float], ...]:
    """Demand that doubles and halves every 90 s over ten minutes: rises of 2 within a
    90 s start, often enough to be covered."""
    return tuple((t, demand if (t // 90) % 2 == 0 else demand / 2)
                 for t in range(0, 600, 15))


def _decide(convertible: ConvertiblePrefill | None) -> dict[str, int]:
    pre = RolePolicy(1, 8, latency_target=1.0, prior_throughput=6000.0, startup_s=90.0)
    dec = RolePolicy(1, 8, prior_throughput=6000.0)
    cfg = PolicyConfig({PREFILL: pre, DECODE: dec}, convertible=convertible)
    signals = {PREFILL: RoleSignals(latency_p90=0.5, queue_depth=0, token_rate=7000.0,
                                    request_rate=5.0, ready=3),
               DECODE: RoleSignals(queue_depth=0, token_rate=1000.0, request_rate=5.0,
                                   ready=1)}
    state = ScalingState(demand={PREFILL: _rising_history(7000.0)})
    decisions, _ = decide(600.0, signals, cfg, state)
    return {d.role: d.desired for d in decisions}


def test_cleave_sizes_prefill_for_rises_net_of_what_decode_lends() -> None:
    seen = (*_rising_history(7000.0), (600.0, 7000.0))
    assert demand_rise(seen, 90.0, 0.95, 3600.0) == 2.0
    # 7,000 tok/s rising to 14,000: 2.33 replicas of 6,000 -> 3. One decode worker lends
    # 4,500 less its batch's 2 x 1,000 tok/s after the rise: 11,500 / 6,000 -> 2.
    assert _decide(None)[PREFILL] == 3
    assert _decide(LENDING)[PREFILL] == 2


def test_the_simulated_policy_is_told_the_decode_budget_unless_the_router_never_lends() -> None:
    trace = Trace("t", 60, (Request(1.0, 1000, 100),))
    lending = cleave_config(CFG, trace, 8).convertible
    assert lending is not None and lending.tokens_per_step == CFG.decode_budget()
    assert lending.step_s == pytest.approx(0.04)  # the TPOT target the budget is sized for
    assert 150 < lending.tokens_per_step < 200  # the 70B's budget at 40 ms on 2 x H200
    assert convertible_prefill(replace(CFG, convertible=False)) is None
    assert convertible_prefill(replace(CFG, aggregated=True)) is None


def _steady_then(rate: float, then: float, split: float, duration: float) -> Trace:
    n, m = int(rate * split), int(then * (duration - split))
    reqs = [Request(i / rate, 1280, 220) for i in range(n)]
    reqs += [Request(split + i / then, 1280, 220) for i in range(m)]
    return Trace("t", duration, tuple(reqs))


def test_the_oracle_meets_a_rise_with_lent_capacity_as_the_policy_does() -> None:
    trace = _steady_then(3.5, 8.0, 600.0, 1200.0)
    lending, alone = oracle_schedule(CFG, trace, 0.8), \
        oracle_schedule(replace(CFG, convertible=False), trace, 0.8)
    at = {t: (a[PREFILL], b[PREFILL])
          for t, a, b in zip(lending.times, lending.replicas, alone.replicas, strict=True)}
    assert at[0.0] == (1, 1)
    assert at[540.0] == (2, 3)  # the rise ahead: 2 prefill and the decode worker's lent
    assert at[660.0] == (3, 3)  # once the load is there it is the prefill workers'


def test_static_is_sized_from_a_lower_bound_that_counts_what_decode_lends() -> None:
    trace = _steady_then(7.0, 7.0, 600.0, 1200.0)
    p, d = capacity_estimate(CFG, trace, 1.0)
    assert (p, d) == (2, 1)  # 8,960 prompt tok/s on 6,311 per prefill replica
    lp, ld = static_lower_bound(CFG, trace)
    assert ld == d and lp == 1  # one decode worker lends ~2,900 of them
    assert static_lower_bound(replace(CFG, convertible=False), trace) == (p, d)
