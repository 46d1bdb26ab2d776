"""The honest simulator of issue 18: convertible routing, chunked prefill on decode workers,
flips, slow first steps, the one-worker floor, and llm-d's published experiment."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cleave.autoscaling.baselines import StaticAutoscaler
from cleave.autoscaling.costmodel import build_cost_model, load_hf_config
from cleave.autoscaling.flips import FlipPlan, WorkerView
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.replicate import ramp_cost, run_ramp
from cleave.autoscaling.scenarios import run_policy
from cleave.autoscaling.simreplicas import Lifetime, SimRequest
from cleave.autoscaling.simulator import SimConfig, simulate
from cleave.autoscaling.simworker import BOTH, EngineConfig, Worker
from cleave.autoscaling.traces import Request, Trace, llmd_ramp, poisson

COST = build_cost_model("H200", "70b")
CFG = SimConfig(COST)
QWEN = Path(__file__).parents[2] / "bench" / "models" / "Qwen3-32B"


def test_qwen3_32b_shape_from_its_config_json() -> None:
    m = load_hf_config(QWEN)
    assert m.params == pytest.approx(32.76e9, rel=0.01)  # Qwen3-32B: 32.8 B parameters
    assert m.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # 256 KiB
    assert m.attn_dim == 64 * 128 != m.hidden
    assert build_cost_model("H100", str(QWEN)).prefill_tp == 2  # 65.5 GB: TP=2 on H100


def test_a_prefill_chunk_slows_a_decode_step_and_the_budget_bounds_it() -> None:
    plain = COST.step_seconds(64, 64_000)
    mixed = COST.step_seconds(64, 64_000, chunk=512)
    assert mixed > 1.5 * plain  # 512 tokens of a 70B: compute-bound
    budget = COST.chunk_budget(0.04)
    assert COST.step_seconds(0, 0, budget) < 0.04 < COST.step_seconds(0, 0, 3 * budget)
    assert COST.step_seconds(0, 0, 1000) == pytest.approx(COST.prefill_seconds(1000))


def test_a_decode_worker_prefills_whole_requests_in_chunks_and_holds_their_kv() -> None:
    w = Worker("d", DECODE, Lifetime(0.0, -100.0), COST, EngineConfig(decode_budget=200))
    req = SimRequest(0.0, 1000, 10)
    end = w.submit(req, 0.0, handoff=False)
    assert end is not None and w.kv_usage == pytest.approx(1010 / w.capacity)
    steps = 0
    while req.t_first == float("inf"):
        assert end is not None
        _, _, end = w.step_done(end)
        steps += 1
    assert steps == 5  # 1000 tokens in chunks of 200
    while end is not None:
        _, _, end = w.step_done(end)
    assert req.t_done < float("inf") and w.reserved == 0


def test_a_flip_stops_intake_for_the_flip_time_and_keeps_work_in_flight() -> None:
    w = Worker("d", DECODE, Lifetime(0.0, 0.0), COST, EngineConfig(decode_budget=200))
    w.admit(SimRequest(0.0, 100, 50), 0.0)
    w.flip(PREFILL, 10.0, 5.0)
    assert not w.serves(PREFILL, 12.0) and not w.serves(DECODE, 12.0)
    assert w.serves(PREFILL, 15.0) and w.running == 1  # the stream finishes where it is


def test_prefill_workers_serve_whole_requests_while_no_decode_worker_is_up() -> None:
    res = simulate(poisson(120, 2.0, seed=0), replace(CFG, initial=(1, 0)),
                   StaticAutoscaler({PREFILL: 1, DECODE: 0}))
    assert res.paths == {"prefill_only": len(res.requests)}
    assert all(r.t_done < float("inf") for r in res.requests)


def test_new_workers_are_slow_for_their_first_steps() -> None:
    trace = Trace("t", 60, tuple(Request(1.0 + i, 4000, 2) for i in range(20)))
    fast = simulate(trace, replace(CFG, initial=(1, 1)), StaticAutoscaler({PREFILL: 1,
                                                                           DECODE: 1}))
    cold = replace(CFG, initial=(0, 0), cold_start_s=0.0,
                   engine=EngineConfig(warmup_s=600, warmup_slowdown=2.0))
    slow = simulate(trace, cold, StaticAutoscaler({PREFILL: 1, DECODE: 1}))
    pairs = [(a, b) for a, b in zip(slow.requests, fast.requests, strict=True)
             if a.arrival > 16]  # after the first tick started the workers
    assert pairs and all(a.ttft > 1.5 * b.ttft for a, b in pairs)


def test_cleave_takes_the_one_worker_floor_at_low_load_and_leaves_it_on_a_rise() -> None:
    trace = poisson(1800, 0.3, seed=0)
    res = run_policy("cleave", trace, CFG, 8)
    assert res.flips >= 1 and res.paths.get("both", 0) > 0
    last = res.samples[-1]
    assert last.gpus == COST.decode_tp  # one worker holds the service
    assert res.slo_attainment() > 0.99


class _Flipper:
    name = "flipper"

    def decide(self, now: float, obs: object) -> dict[str, tuple[int, str]]:
        return {PREFILL: (2, "t"), DECODE: (1, "t")}

    def plan(self, now: float, obs: object, desired: dict[str, int],
             workers: list[WorkerView]) -> FlipPlan:
        from cleave.autoscaling.flips import plan_flips

        return plan_flips(desired, workers)


def test_a_flip_covers_a_starved_role_in_seconds_where_a_replica_takes_a_cold_start() -> None:
    trace = poisson(300, 6.0, seed=1)
    cfg = replace(CFG, initial=(1, 2), cold_start_s=600.0, flip_s=5.0, convertible=False)
    res = simulate(trace, cfg, _Flipper())
    assert res.flips == 1 and not any(n for n in (s.starting[0] for s in res.samples[2:]))
    assert res.samples[2].ready[0] == 2  # ready within the first intervals, not 600 s


def test_llmd_ramp_and_its_replication() -> None:
    trace = llmd_ramp(0)
    assert trace.duration == 2430 and len(trace.requests) == 12480
    assert all(3500 <= r.prompt_tokens <= 4500 and 900 <= r.output_tokens <= 1100
               for r in trace.requests)
    res, avg = run_ramp("llmd", ramp_cost(str(QWEN)), 0)
    assert min(s.ready[1] for s in res.samples) >= 3 and max(s.ready[1] for s in res.samples) == 8
    assert 3 < avg < 8 and res.paths == {BOTH: len(res.requests)}
