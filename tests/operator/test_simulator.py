"""The autoscaling simulator: cost model, traces, and regression tests of whole simulations."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from cleave.autoscaling.baselines import Observation, StaticAutoscaler
from cleave.autoscaling.costmodel import MODELS, build_cost_model, load_gpu
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.scenarios import run_policy
from cleave.autoscaling.simulator import SimConfig, simulate
from cleave.autoscaling.traces import (
    Request,
    Trace,
    bursty,
    load_jsonl,
    make_trace,
    poisson,
    step,
    write_jsonl,
)

COST = build_cost_model("H200", "70b")


# --- cost model --------------------------------------------------------------------------

def test_70b_on_h200_constants() -> None:
    m = MODELS["70b"]
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB per token
    assert m.weight_bytes == pytest.approx(141.1e9)
    assert (COST.prefill_tp, COST.decode_tp) == (2, 2)  # 141 GB of weights: two H200s
    assert build_cost_model("H100", "70b").decode_tp == 4  # ... four H100s
    # prefill: 2 * N * n / (2 GPUs * 989 TFLOP/s * 0.45), plus the causal attention term
    flops = 2 * 989.4e12 * 0.45
    dense, attention = 2 * m.params * 1000 / flops, 2 * 80 * 8192 * 1000**2 / flops
    assert COST.prefill_seconds(1000) == pytest.approx(dense + attention)
    assert attention < 0.01 * dense  # at 1k tokens; at 8k it is 7 %
    # decode: weights plus the batch's KV, read at 2 * 4.8 TB/s * 0.7, plus the step overhead
    step_s = (m.weight_bytes + 64_000 * m.kv_bytes_per_token) / (2 * 4.8e12 * 0.7) + 0.003
    assert COST.decode_step_seconds(32, 64_000) == pytest.approx(step_s)
    assert COST.kv_capacity_tokens() == int((2 * 141e9 * 0.9 - m.weight_bytes)
                                            / m.kv_bytes_per_token)


def test_bigger_batches_amortise_the_weight_read() -> None:
    one = 1 / COST.decode_step_seconds(1, 1000)
    many = 64 / COST.decode_step_seconds(64, 64_000)
    assert 10 * one < many < 64 * one


def test_gpu_constants_from_a_file_and_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "gpu.json"
    good.write_text(json.dumps({"name": "X1", "flops": 1e14, "bandwidth": 1e12, "memory": 4e10,
                                "bandwidth_efficiency": 0.5}))
    gpu = load_gpu(str(good))
    assert (gpu.name, gpu.bandwidth_efficiency, gpu.compute_efficiency) == ("X1", 0.5, 0.45)
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "X2"}')
    with pytest.raises(ValueError, match="not a GPU constants file"):
        load_gpu(str(bad))
    with pytest.raises(ValueError, match="unknown GPU 'B200'"):
        load_gpu("B200")
    with pytest.raises(ValueError, match="unknown model"):
        build_cost_model("H200", "405b")
    with pytest.raises(ValueError, match="no KV room"):
        build_cost_model("H100", "70b", decode_tp=1)


def test_local_profile_is_measured() -> None:
    gpu = load_gpu("local")
    assert gpu.flops > 1e8 and gpu.bandwidth > 1e8 and gpu.memory > 1e8
    assert build_cost_model(gpu, "smollm2-135m").prefill_seconds(100) > 0


# --- traces ------------------------------------------------------------------------------

def test_traces_are_deterministic_per_seed() -> None:
    assert poisson(300, 3.0, seed=4) == poisson(300, 3.0, seed=4)
    assert poisson(300, 3.0, seed=4).requests != poisson(300, 3.0, seed=5).requests
    assert bursty(600, 3.0, seed=1) == bursty(600, 3.0, seed=1)


def test_step_trace_is_2_then_10_then_1() -> None:
    t = step(1800, seed=0)
    counts = [sum(i * 600 <= r.arrival < (i + 1) * 600 for r in t.requests) for i in range(3)]
    assert [round(c / 600) for c in counts] == [2, 10, 1]


def test_bursty_trace_keeps_its_mean_and_is_burstier_than_poisson() -> None:
    t = bursty(4 * 3600, 5.0, seed=0)
    assert len(t.requests) / t.duration == pytest.approx(5.0, rel=0.25)
    gaps = [b.arrival - a.arrival for a, b in zip(t.requests, t.requests[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv > 1.3  # Poisson arrivals have 1
    assert t.peak_rate() > 2 * 5.0


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    t = poisson(60, 2.0, seed=0)
    write_jsonl(t, path)
    back = load_jsonl(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in back.requests] == \
        [(r.prompt_tokens, r.output_tokens) for r in t.requests]
    assert back.requests[0].arrival == 0.0  # shifted to start at zero
    assert make_trace(str(path), 30.0).duration == 30.0


@pytest.mark.parametrize(("line", "error"), [
    ("not json", r":2: not JSON"),
    ("[1, 2]", r":2: expected an object"),
    ('{"prompt_tokens": 5, "output_tokens": 5}', r":2: missing arrival_s or timestamp"),
    ('{"arrival_s": 1, "prompt_tokens": "5", "output_tokens": 5}', r"prompt_tokens must be"),
    ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 5}', r"whole token counts >= 1"),
    ('{"arrival_s": -1, "prompt_tokens": 4, "output_tokens": 5}', r"arrival_s >= 0"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, error: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 3}\n' + line + "\n")
    with pytest.raises(ValueError, match=error):
        load_jsonl(path)


def test_jsonl_empty_or_missing(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="cannot read trace"):
        load_jsonl(tmp_path / "absent.jsonl")


# --- whole simulations -------------------------------------------------------------------

CFG = SimConfig(COST, cold_start_s=60.0)


def test_a_simulation_is_deterministic() -> None:
    t = bursty(900, 4.0, seed=3)
    a = run_policy("cleave", t, CFG, 8).summary()
    b = run_policy("cleave", t, CFG, 8).summary()
    assert a == b and a["requests"] == len(t.requests) == a["finished"]


def test_static_with_enough_replicas_meets_the_slos() -> None:
    res = run_policy("static", poisson(600, 3.0, seed=1), CFG, 8, static=(2, 1))
    assert res.slo_attainment() >= 0.99
    # replica-hours: 2 prefill and 1 decode replicas for the whole 600 s, 2 GPUs each
    assert res.replica_seconds == {PREFILL: pytest.approx(1200), DECODE: pytest.approx(600)}
    assert res.gpu_hours() == pytest.approx(1.0)


def test_underprovisioned_static_fails_the_ttft_slo() -> None:
    trace = poisson(600, 8.0, seed=1)
    res = run_policy("static", trace, replace(CFG, convertible=False), 8, static=(1, 1))
    assert res.ttft_attainment() < 0.5  # 8 req/s of ~1.3k tokens need two prefill replicas
    # The router's backlog rule sends late prompts whole to the decode worker, which prefills
    # them in chunks inside its decode steps: the same two replicas serve far more in time.
    conv = run_policy("static", trace, CFG, 8, static=(1, 1))
    assert conv.ttft_attainment() > res.ttft_attainment() + 0.2
    assert conv.paths["prefill_backlog"] > 0
    assert res.tpot_attainment() > 0.99  # one decode replica is plenty


def test_kv_capacity_holds_decode_requests_back() -> None:
    long_outputs = Trace("long", 300, tuple(Request(i * 0.2, 4000, 1500) for i in range(300)))
    res = run_policy("static", long_outputs, CFG, 8, static=(4, 1))
    # about 300 sequences of 5.5k tokens would be decoding at once: the KV holds about 60
    assert COST.kv_capacity_tokens() < 70 * 5500
    assert res.ttft_attainment() > 0.99
    assert res.tpot_attainment() < 0.5  # requests wait for KV after their first token
    assert max(s.tpot_p90 or 0 for s in res.samples) > 0.05


class _AskOnce:
    """Asks for ``want`` replicas of each role from the first tick on, and records what the
    simulator showed it."""

    name = "ask"

    def __init__(self, want: int) -> None:
        self.want = want
        self.seen: list[tuple[float, Observation]] = []

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        self.seen.append((now, obs))
        return {PREFILL: (self.want, "test"), DECODE: (1, "test")}


def test_cold_start_delays_capacity() -> None:
    trace = poisson(600, 8.0, seed=2)
    results = {}
    for cold in (0.0, 180.0):
        ask = _AskOnce(3)
        cfg = replace(CFG, cold_start_s=cold, initial=(1, 1), convertible=False)
        results[cold] = simulate(trace, cfg, ask)
        starting = [s for s in results[cold].samples if s.starting[0] > 0]
        if cold:
            # asked at the first tick (15 s), serving from 195 s
            assert min(s.t for s in starting) == 15.0 and max(s.t for s in starting) == 180.0
            assert all(o.signals[PREFILL].starting == 2 for t, o in ask.seen if 15 < t < 195)
        else:
            assert not starting
    assert results[180.0].slo_attainment() < results[0.0].slo_attainment() - 0.1
    # the GPUs are held while starting: both runs pay for three prefill replicas from 15 s
    assert results[180.0].gpu_hours() == pytest.approx(results[0.0].gpu_hours(), rel=0.01)


def test_the_autoscaler_sees_only_scraped_windows() -> None:
    trace = Trace("late burst", 600, tuple(Request(300 + i / 20, 1000, 50) for i in range(2000)))
    ask = _AskOnce(1)
    simulate(trace, replace(CFG, initial=(1, 1), convertible=False), ask)
    before = [o.signals[PREFILL] for t, o in ask.seen if t < 300]
    assert before and all(s.token_rate in (None, 0.0) and not s.queue_depth for s in before)
    after = [o.signals[PREFILL] for t, o in ask.seen if 300 < t <= 400]
    assert any((s.queue_depth or 0) > 100 for s in after)
    # The backlog shows as a windowed p90 TTFT of tens of seconds.
    assert any((s.latency_p90 or 0) > 10 for s in after)


def test_cleave_follows_the_step_up_and_back_down() -> None:
    res = run_policy("cleave", step(2700, seed=0), CFG, 8)
    prefill = [(s.t, s.ready[0] + s.starting[0]) for s in res.samples]
    high = max(n for t, n in prefill if 900 <= t < 1800)
    assert high >= 3  # 10 req/s of ~1.3k-token prompts: three replicas of ~6.3k tok/s at 80 %
    assert [n for t, n in prefill if t < 900] == [1] * len([t for t, _ in prefill if t < 900])
    assert prefill[-1][1] == 1  # and back to one at 1 req/s
    assert any("capacity" in why for _, role, _, why in res.reasons if role == PREFILL)
    # it costs less than keeping the peak the whole time
    static = run_policy("static", step(2700, seed=0), CFG, 8, static=(high, 1))
    assert res.gpu_hours() < 0.85 * static.gpu_hours()


def test_static_autoscaler_holds_its_counts() -> None:
    sa = StaticAutoscaler({PREFILL: 2, DECODE: 3})
    assert sa.decide(0.0, Observation({}, {})) == {PREFILL: (2, "static"), DECODE: (3, "static")}


def test_requests_held_by_the_router_go_to_a_replica_ready_at_once() -> None:
    # No worker at first: the router holds the arrivals until the first tick adds some,
    # which (no cold start) are ready at once and must receive them. (With only a decode
    # worker up, it would serve them whole: see the test of the router's paths.)
    cfg = replace(CFG, cold_start_s=0.0, initial=(0, 0))
    res = simulate(poisson(120, 2.0, seed=0), cfg, StaticAutoscaler({PREFILL: 1, DECODE: 1}))
    early = [r for r in res.requests if r.arrival < cfg.interval_s]
    assert early and all(r.t_first >= cfg.interval_s for r in early)
    assert all(math.isfinite(r.t_done) for r in res.requests)
