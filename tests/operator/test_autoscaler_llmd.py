"""llm-d's SLO-aware law as ported (cleave.autoscaling.llmd) and its replication: the signal
read from the gateway's per-request histograms with the EPP's buckets, the formula as llm-d's
benchmark evaluates it, the HPA's windows, and llm-d's score."""

from __future__ import annotations

import math
from pathlib import Path

from cleave.autoscaling.baselines import Observation
from cleave.autoscaling.llmd import (
    EPP_TPOT_BUCKETS,
    EPP_TTFT_BUCKETS,
    LlmdLaw,
    LlmdSloFormula,
    _Hpa,
)
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.autoscaling.replicate import (
    PUBLISHED_AVG_REPLICAS,
    ramp_cost,
    run_ramp,
)
from cleave.autoscaling.signals import TPOT, TTFT
from cleave.autoscaling.simreplicas import Lifetime, SimRequest, _Hist
from cleave.autoscaling.simresult import SimConfig, SimResult
from cleave.autoscaling.simworker import BOTH, EngineConfig, Worker

QWEN = Path(__file__).resolve().parents[2] / "bench" / "models" / "Qwen3-32B"


def _gateway(ttfts: list[float], tpots: list[float]) -> dict[str, _Hist]:
    hists = {TTFT: _Hist(EPP_TTFT_BUCKETS), TPOT: _Hist(EPP_TPOT_BUCKETS)}
    for v in ttfts:
        hists[TTFT].observe(v)
    for v in tpots:
        hists[TPOT].observe(v)
    return hists


def _obs(gw: dict[str, _Hist], ready: int = 8) -> Observation:
    # The workers' own p90s say something else: the law must read the gateway's.
    workers = {PREFILL: RoleSignals(latency_p90=0.1, ready=ready),
               DECODE: RoleSignals(latency_p90=0.001, ready=ready)}
    return Observation(workers, {}, {k: h.snapshot() for k, h in gw.items()})


def test_the_signal_is_the_epp_histograms_p90_interpolated_inside_a_bucket() -> None:
    # Every request at 30 ms TPOT and 0.3 s TTFT: Prometheus' histogram_quantile puts the p90
    # at 90 % of the 20-40 ms bucket, 38 ms: the signal reads 0.38 of a 100 ms SLO, not 0.30.
    law = LlmdSloFormula(3.0, 0.1, {DECODE: 3}, {DECODE: 8})
    gw = _gateway([0.3] * 100, [0.03] * 100)
    assert abs(law.signal(0.0, _obs(gw)) - 0.38) < 1e-9
    # The rate window is one minute: what finished before it no longer counts. A minute of
    # 70 ms requests after the 30 ms ones reads 0.7 (p90 in the 60-80 ms bucket) by itself.
    for t in (15.0, 30.0, 45.0, 60.0, 75.0):
        for _ in range(20):
            gw[TPOT].observe(0.07)
        raw = law._p90s(t, _obs(gw))[1]
    assert raw is not None and abs(raw - 0.078) < 1e-9


def test_the_credited_ask_below_n_is_held_by_the_hpa_down_window() -> None:
    law = LlmdLaw()
    hpa = _Hpa()
    assert hpa.decide(0.0, 6, 6, 3, 8, law) == 6  # the pool held at 6
    # 15 s later the credited formula asks 5 (signal 0.6, 4 of 6 ready): the 180 s down
    # window still remembers asking 6, so nothing is shed mid-scale-up.
    assert hpa.decide(15.0, 6, 5, 3, 8, law) == 6
    assert hpa.decide(181.0, 6, 5, 3, 8, law) == 5  # once the window agrees: one pod down


def test_llmd_scores_a_request_that_misses_both_slos_twice() -> None:
    ok, slow_first, slow_both = (SimRequest(0.0, 10, 11) for _ in range(3))
    ok.t_first, ok.t_done = 1.0, 2.0  # TPOT 0.1 s
    slow_first.t_first, slow_first.t_done = 5.0, 6.0
    slow_both.t_first, slow_both.t_done = 5.0, 8.0
    res = SimResult("llmd", "t", 10.0, SimConfig(ramp_cost(str(QWEN)), ttft_slo=3.0,
                                                 tpot_slo=0.1), [ok, slow_first, slow_both],
                    {})
    assert res.slo_attainment() == 1 / 3
    assert res.llmd_attainment() == 1 - 3 / 3  # llm-d's sum of per-type violations


def test_the_replication_lands_one_capacity_crossing_and_the_published_replicas() -> None:
    res, avg = run_ramp("llmd", ramp_cost(str(QWEN)), 0)
    # One crossing (the 6 req/s stage on the 3-replica floor), then 8 replicas through the
    # peak: the pool never drops below 8 between the scale-up and the end of the 10 req/s
    # stage (the measured-p90 signal read without the EPP's buckets drained it at 8 req/s).
    up = next(s.t for s in res.samples if s.ready[1] == 8)
    assert 900 <= up <= 1000
    assert all(s.ready[1] == 8 for s in res.samples if up <= s.t <= 1770)
    assert abs(avg - PUBLISHED_AVG_REPLICAS) < 0.6
    assert 0.9 < res.llmd_attainment() < 0.958


def _drive(reserve_output: bool) -> tuple[Worker, list[SimRequest], int]:
    """80 requests of 4,000 + 1,000 tokens at once on one vLLM-style worker (its KV holds
    about 300k tokens: 59 such sequences whole, 74 prompts): run it until all are done."""
    cost = ramp_cost(str(QWEN))
    w = Worker("w", DECODE, Lifetime(0.0, -60.0), cost,
               EngineConfig(both_budget=8192, warmup_s=0.0, reserve_output=reserve_output),
               BOTH)
    reqs = [SimRequest(0.0, 4000, 1000) for _ in range(80)]
    end = None
    for r in reqs:
        end = w.submit(r, 0.0, False) or end
    most = 0
    while end is not None:
        _, _, end = w.step_done(end)
        most = max(most, w.running)
    return w, reqs, most


def test_vllm_style_kv_admits_on_the_prompt_and_preempts_the_newest_when_full() -> None:
    whole, whole_reqs, whole_most = _drive(True)
    grow, grow_reqs, grow_most = _drive(False)
    assert whole.preemptions == 0 and grow.preemptions > 0
    assert grow_most > whole_most  # more sequences at once: they hold only what they wrote
    for w, reqs in ((whole, whole_reqs), (grow, grow_reqs)):
        assert all(r.t_first < r.t_done < math.inf for r in reqs)
        assert w.reserved == 0 and w.context == 0 and not w.joined  # every token given back
    # A preempted sequence recomputes and resumes: it finishes, later than it would have.
    assert max(r.tpot for r in grow_reqs) > max(r.tpot for r in whole_reqs)
