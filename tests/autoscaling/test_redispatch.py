"""Re-dispatch (SimConfig.redispatch): when a worker becomes ready, the prompts still queued on
the others, not started and still able to meet the router's TTFT target, are routed again."""

from __future__ import annotations

from dataclasses import replace

from cleave.autoscaling.baselines import StaticAutoscaler
from cleave.autoscaling.costmodel import build_cost_model
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.simreplicas import Lifetime, SimRequest
from cleave.autoscaling.simulator import SimConfig, simulate
from cleave.autoscaling.simworker import EngineConfig, Worker
from cleave.autoscaling.traces import Request, Trace

COST = build_cost_model("H200", "70b")
CFG = SimConfig(COST)


def test_a_worker_gives_up_only_the_prompts_it_has_not_started() -> None:
    w = Worker("p", PREFILL, Lifetime(0.0, -100.0), COST, EngineConfig(decode_budget=200))
    reqs = [SimRequest(float(i), 2000, 10) for i in range(4)]
    for r in reqs:
        w.submit(r, 4.0, handoff=True)
    assert w.withdraw(arrived_after=1.5) == reqs[2:]  # the head computes; 1 is too old
    assert [j.req for j in w.jobs] == reqs[:2] and w.queued_tokens == 4000
    assert w.withdraw() == [reqs[1]]
    assert [j.req for j in w.jobs] == [reqs[0]]


def test_a_decode_worker_keeps_a_whole_request_whose_prefill_has_begun() -> None:
    w = Worker("d", DECODE, Lifetime(0.0, -100.0), COST, EngineConfig(decode_budget=200))
    first, second = SimRequest(0.0, 1000, 10), SimRequest(0.0, 1000, 10)
    end = w.submit(first, 0.0, handoff=False)
    w.submit(second, 0.0, handoff=False)
    assert end is not None
    w.step_done(end)  # a chunk of the first is done, the next one is on its way
    assert w.withdraw() == [second]
    assert [j.req for j in w.jobs] == [first]


def _burst_while_a_worker_starts() -> tuple[Trace, SimConfig]:
    """One prefill worker, a second asked for at the first tick (15 s) and ready 1 s later;
    twelve 3k-token prompts arrive just before it is: about 6 s of prefill on the first."""
    trace = Trace("burst", 60, tuple(Request(15.5 + 0.04 * i, 3000, 20) for i in range(12)))
    cfg = replace(CFG, initial=(1, 1), cold_start_s=1.0, convertible=False,
                  engine=EngineConfig(warmup_s=0.0))
    return trace, cfg


def test_prompts_queued_behind_a_backlog_move_to_a_worker_that_becomes_ready() -> None:
    trace, cfg = _burst_while_a_worker_starts()
    scaler = StaticAutoscaler({PREFILL: 2, DECODE: 1})
    stay = simulate(trace, cfg, scaler)
    moved = simulate(trace, replace(cfg, redispatch=True), scaler)
    assert stay.redispatched == 0 and moved.redispatched >= 4
    assert moved.ttft_attainment() > stay.ttft_attainment()
    # Routed twice, counted once.
    assert sum(moved.paths.values()) == len(trace.requests)
