"""The policy's demand side, found in simulation: queue growth, backlog, learned headroom."""

from __future__ import annotations

from typing import Any

import pytest
from policy_support import NOW, one

from cleave.autoscaling.demand import demand_rise
from cleave.autoscaling.policy import (
    PREFILL,
    RolePolicy,
    RoleSignals,
    ScalingState,
)

# --- demand: queue growth, backlog, learned headroom (the simulator's findings) -------------

CAP = RolePolicy(1, 20, latency_target=1.0, max_step_up=10, prior_throughput=1000.0)


def queued(depth: float, ready: int, age: float = 15.0, role: str = PREFILL) -> ScalingState:
    return ScalingState(queues={role: (NOW - age, depth, ready)})


def test_a_measured_throughput_only_raises_the_prior() -> None:
    # 100 tok/s was measured with a queue at one scrape: proof of at least 100, not of at most
    sig = RoleSignals(latency_p90=1.0, token_rate=3000.0, throughput_per_replica=100.0, ready=4)
    d = one(CAP, sig)
    assert d.desired == 4 and d.inputs["need_capacity"] == "4"  # 3000 / (1000 * 0.8)


def test_queue_growth_is_demand_the_served_rate_hides() -> None:
    # served 2000 tok/s at 2 req/s while the queue grew 1 req/s: 3000 tok/s arrive
    sig = RoleSignals(latency_p90=1.0, token_rate=2000.0, request_rate=2.0, queue_depth=10,
                      ready=4)
    d = one(CAP, sig, queued(depth=-5, ready=4))
    assert d.inputs["demand"] == "3000" and d.inputs["queue_growth"] == "1"
    # and a draining backlog (served > arriving) is not read as demand
    d = one(CAP, sig, queued(depth=25, ready=4))
    assert d.inputs["demand"] == "1000" and d.desired == 4  # down waits for its window


def test_replicas_holding_a_growing_backlog_do_not_count_for_new_demand() -> None:
    # requests are dispatched on arrival: the 2 ready replicas keep their backlog, so the
    # 4000 tok/s demand (5 replicas at 80 %) needs replicas besides them
    sig = RoleSignals(latency_p90=9.0, token_rate=2000.0, request_rate=2.0, queue_depth=40,
                      ready=2)
    d = one(CAP, sig, queued(depth=10, ready=2))
    assert d.desired == 7 and "2 ready replicas held" in d.inputs["backlog"]
    # replicas that only just became ready hold none of it
    d = one(CAP, replace_ready(sig, 3), queued(depth=10, ready=1))
    assert d.inputs["need_capacity"] == "6"


def replace_ready(sig: RoleSignals, ready: int) -> RoleSignals:
    return RoleSignals(**{**sig.__dict__, "ready": ready})


def test_with_a_capacity_model_latency_adds_one_replica_at_a_time() -> None:
    sig = RoleSignals(latency_p90=3.0, token_rate=1000.0, request_rate=1.0, queue_depth=10,
                      ready=2)
    d = one(CAP, sig, queued(depth=10, ready=2))
    assert d.desired == 3 and d.inputs["need_ttft"] == "3"  # not ready * 3 = 6
    without_model = RolePolicy(1, 20, latency_target=1.0, max_step_up=10)
    assert one(without_model, sig).desired == 6  # the latency error alone still sizes


@pytest.mark.parametrize(("sig", "state", "why"), [
    (RoleSignals(latency_p90=3.0, token_rate=1000.0, queue_depth=10, ready=2, starting=1),
     queued(10, 2), "replicas starting"),
    (RoleSignals(latency_p90=3.0, token_rate=1000.0, queue_depth=10, ready=3),
     queued(10, 2), "just became ready"),
    (RoleSignals(latency_p90=3.0, token_rate=1000.0, queue_depth=10, ready=2),
     queued(30, 2), "queue draining"),
    (RoleSignals(latency_p90=3.0, token_rate=1000.0, queue_depth=3, ready=2),
     queued(3, 2), "under two waiting requests per replica"),
])
def test_latency_breaches_that_more_replicas_cannot_fix_are_held(
        sig: RoleSignals, state: ScalingState, why: str) -> None:
    d = one(CAP, sig, state)
    assert d.desired == sig.ready + sig.starting and why in d.inputs["ttft_held"]


def test_latency_under_target_leaves_the_size_to_the_capacity_model() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=0, prior_throughput=1000.0)
    d = one(pol, RoleSignals(latency_p90=0.5, token_rate=500.0, ready=4))
    assert d.desired == 3 and "need_ttft" not in d.inputs  # ready * 0.5 would have held 2 more


def test_headroom_for_the_rises_seen_within_a_startup_time() -> None:
    # demand doubled within 60 s every 5 minutes over the last hour
    hist = tuple((NOW - 3600 + 15 * i, 2000.0 if (i % 20) >= 4 and (i % 20) < 8 else 1000.0)
                 for i in range(240))
    pol = replace_policy(CAP, startup_s=60.0, rise_quantile=0.9)
    state = ScalingState(demand={PREFILL: hist})
    d = one(pol, RoleSignals(latency_p90=1.0, token_rate=2000.0, ready=2), state)
    assert d.inputs["rise"] == "2" and d.desired == 4  # 2000 * 2 / 1000, not 2000 / 800
    assert demand_rise(hist, 60.0, 0.95, 3600.0) == 2.0
    # one step, however large, is not a habit: time not seen counts as no rise
    once = tuple((15.0 * i, 1000.0 if i < 20 else 5000.0) for i in range(32))
    assert demand_rise(once, 60.0, 0.9, 3600.0) == 1.0  # 4 rising samples of 240
    assert demand_rise(once, 60.0, 0.9, 465.0) == 5.0  # 4 of 31


def replace_policy(p: RolePolicy, **kw: Any) -> RolePolicy:
    return RolePolicy(**{**p.__dict__, **kw})
