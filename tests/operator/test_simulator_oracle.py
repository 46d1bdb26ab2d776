"""The oracle the load-following policies are measured against: replicas on a timetable made
from the trace, up a cold start before the load they serve."""

from __future__ import annotations

import pytest

from cleave.autoscaling.baselines import Observation, ScheduledAutoscaler
from cleave.autoscaling.costmodel import build_cost_model
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.scenarios import (
    capacity_estimate,
    oracle_schedule,
    run_oracle,
    run_policy,
)
from cleave.autoscaling.simulator import SimConfig
from cleave.autoscaling.traces import step

CFG = SimConfig(build_cost_model("H200", "70b"), cold_start_s=90.0)


def test_a_schedule_answers_with_the_entry_in_force() -> None:
    s = ScheduledAutoscaler([0.0, 60.0, 120.0],
                            [{PREFILL: 1, DECODE: 1}, {PREFILL: 3, DECODE: 1},
                             {PREFILL: 2, DECODE: 2}])
    obs = Observation({}, {})
    assert s.decide(0.0, obs)[PREFILL] == (1, "scheduled")
    assert s.decide(59.9, obs)[PREFILL] == (1, "scheduled")
    assert s.decide(60.0, obs)[PREFILL] == (3, "scheduled")
    assert s.decide(1e6, obs) == {PREFILL: (2, "scheduled"), DECODE: (2, "scheduled")}
    with pytest.raises(ValueError):
        ScheduledAutoscaler([0.0], [])


def test_the_oracle_is_up_a_cold_start_before_the_step() -> None:
    trace = step(2700, seed=0)  # 2 req/s, then 10 from t = 900 s, then 1 from 1800 s
    oracle = oracle_schedule(CFG, trace, 0.8)
    high = capacity_estimate(CFG, trace, 0.8, 10.0)[0]
    by_time = dict(zip(oracle.times, (r[PREFILL] for r in oracle.replicas), strict=True))
    assert by_time[0.0] < high
    # Ready by 900 s means started by 900 - 90 - one interval: the 780 s window already asks.
    assert by_time[780.0] >= high - 1 and by_time[840.0] >= high - 1
    assert by_time[1860.0] < high  # and down once the step has passed


def test_knowing_the_load_beats_following_it_on_the_step() -> None:
    trace = step(2700, seed=0)
    known = run_oracle(CFG, trace, 0.8)
    followed = run_policy("cleave", trace, CFG, 12)
    assert known.slo_attainment() >= 0.99
    assert known.slo_attainment() >= followed.slo_attainment()
