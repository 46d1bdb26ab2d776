"""The per-role SLO autoscaling policy: one or more tests per rule, plus hypothesis properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_support import DEC, NOW, PRE, hist, one, two

from cleave.autoscaling.costmodel import build_cost_model, prefill_tokens_per_second
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    PolicyConfig,
    RolePolicy,
    RoleSignals,
    ScalingState,
    decide,
)
from cleave.operator.autoscaler.policy_from_spec import config_from_spec
from cleave.operator.spec import SpecError, parse_spec

# --- SLO error per role --------------------------------------------------------------------------

def test_prefill_scales_on_ttft_error() -> None:
    d = one(PRE, RoleSignals(latency_p90=2.0, ready=2))
    assert (d.current, d.desired) == (2, 4)
    assert "ttft asks for 4" in d.reason


def test_decode_scales_on_tpot_error() -> None:
    d = one(DEC, RoleSignals(latency_p90=0.1, kv_usage=0.8, ready=2), role=DECODE)
    assert d.desired == 4 and "tpot asks for 4" in d.reason


def test_decode_scales_on_kv_pressure_alone() -> None:
    d = one(DEC, RoleSignals(latency_p90=0.05, kv_usage=0.96, ready=2), role=DECODE)
    assert d.desired == 3 and "kv asks for 3" in d.reason


def test_scale_down_needs_every_signal_to_agree() -> None:
    calm = RolePolicy(1, 20, 0.05, 0.8, down_window_s=0)
    d = one(calm, RoleSignals(latency_p90=0.01, kv_usage=0.8, ready=4), role=DECODE)
    assert d.desired == 4  # tpot is far under target, but the KV is at its watermark


# --- capacity model --------------------------------------------------------------------------

def test_capacity_model_from_measured_throughput() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, max_step_up=10)
    sig = RoleSignals(latency_p90=1.0, token_rate=1000.0, throughput_per_replica=200.0, ready=2)
    d = one(pol, sig)  # 1000 / (200 * 0.8) = 6.25 replicas although TTFT is on target
    assert d.desired == 7 and "capacity asks for 7" in d.reason


def test_capacity_model_falls_back_to_the_design_arithmetic() -> None:
    prior = prefill_tokens_per_second(n_params=1e8, achieved_flops=4e10)
    assert prior == pytest.approx(200.0)
    pol = RolePolicy(1, 20, latency_target=1.0, max_step_up=10, prior_throughput=prior)
    d = one(pol, RoleSignals(latency_p90=1.0, token_rate=1000.0, ready=2))
    assert d.desired == 7


def test_decode_arithmetic_batching_amortises_the_weight_read() -> None:
    # The capacity model's decode step (the simulator's and the prior's): a step reads the
    # weights once plus every sequence's KV, so eight sequences go faster, not eight times.
    cost = build_cost_model("H200", "70b")
    one_seq = 1 / cost.decode_step_seconds(1, 2000)
    eight = 8 / cost.decode_step_seconds(8, 8 * 2000)
    assert one_seq < eight < 8 * one_seq


# --- hysteresis, stabilization, steps, bounds -----------------------------------------------

@pytest.mark.parametrize(("latency", "desired"), [(1.08, 2), (0.92, 2), (1.2, 3)])
def test_hysteresis_band(latency: float, desired: int) -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=0)
    assert one(pol, RoleSignals(latency_p90=latency, ready=2)).desired == desired


def test_fast_up_slow_down_by_default() -> None:
    assert RolePolicy().up_window_s == 0 < RolePolicy().down_window_s
    assert RolePolicy().max_step_up > RolePolicy().max_step_down


def test_up_window_waits_for_a_sustained_breach() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, up_window_s=60)
    sig = RoleSignals(latency_p90=2.0, ready=2)
    assert one(pol, sig, hist((30, 2))).desired == 2  # one spike: not yet
    assert one(pol, sig, hist((30, 4))).desired == 4  # the whole window agrees


def test_down_window_holds_until_it_has_passed() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=300)
    sig = RoleSignals(latency_p90=0.25, ready=4)
    assert one(pol, sig, hist((100, 4))).desired == 4
    d = one(pol, sig, hist((400, 4)))  # that recommendation left the window
    assert d.desired == 3 and "down to 3" in d.reason  # and one step at a time


def test_max_step_per_interval() -> None:
    assert one(PRE, RoleSignals(latency_p90=10.0, ready=2)).desired == 6
    fast = RolePolicy(1, 20, latency_target=1.0, down_window_s=0, max_step_down=2)
    assert one(fast, RoleSignals(latency_p90=0.1, ready=5)).desired == 3


def test_min_and_max_bound_the_result() -> None:
    d = one(RolePolicy(1, 5, latency_target=1.0), RoleSignals(latency_p90=10.0, ready=2))
    assert d.desired == 5 and "bounded to [1, 5]" in d.reason
    low = RolePolicy(3, 9, latency_target=1.0, down_window_s=0, max_step_down=5)
    assert one(low, RoleSignals(latency_p90=0.1, ready=5)).desired == 3


# --- starting and pending replicas ----------------------------------------------------------

def test_starting_replicas_get_credit() -> None:
    d = one(PRE, RoleSignals(latency_p90=1.8, ready=2, starting=2))
    assert (d.current, d.desired) == (4, 4)  # the 2 on their way cover ceil(2 * 1.8)
    assert one(PRE, RoleSignals(latency_p90=3.0, ready=2, starting=2)).desired == 6


def test_pending_replicas_are_not_capacity() -> None:
    d = one(PRE, RoleSignals(latency_p90=2.5, ready=2, pending=2))
    assert (d.current, d.desired) == (4, 5)
    d = one(PRE, RoleSignals(latency_p90=1.5, ready=2, pending=2))
    assert d.desired == 3 and "drop 1 pending" in d.reason  # no window for pods that serve nothing


def test_pending_scale_up_does_not_block_scale_down() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=0)
    d = one(pol, RoleSignals(latency_p90=0.3, ready=3, pending=2))
    assert (d.current, d.desired) == (5, 2)


# --- missing signals ------------------------------------------------------------------------

def test_missing_latency_holds_and_is_never_zero_latency() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=0)
    d = one(pol, RoleSignals(latency_p90=None, queue_depth=5, ready=3))
    assert d.desired == 3 and "hold: ttft missing or stale" in d.reason


def test_missing_kv_usage_holds() -> None:
    d = one(DEC, RoleSignals(latency_p90=0.2, kv_usage=None, ready=3), role=DECODE)
    assert d.desired == 3 and "kv usage missing" in d.reason


def test_no_ready_replica_holds() -> None:
    d = one(PRE, RoleSignals(latency_p90=5.0, ready=0, starting=2))
    assert d.desired == 2 and "no ready replica" in d.reason


def test_a_hold_is_not_recorded_as_a_recommendation() -> None:
    _, state = decide(NOW, {PREFILL: RoleSignals(ready=3)}, PolicyConfig({PREFILL: PRE}),
                      hist((10, 3), (5000, 9)))
    assert state.history[PREFILL] == ((NOW - 10, 3),)  # stale entries pruned, nothing added


# --- scale to zero and from zero ------------------------------------------------------------

ZERO = RolePolicy(0, 4, latency_target=1.0, down_window_s=0)
IDLE = RoleSignals(queue_depth=0, token_rate=0, ready=1)


def test_coordinated_scale_to_zero() -> None:
    out = two(IDLE, IDLE, ZERO, ZERO, scale_to_zero=True)
    assert out[PREFILL].desired == out[DECODE].desired == 0
    assert "idle" in out[PREFILL].reason


def test_no_zero_without_scale_to_zero() -> None:
    out = two(IDLE, IDLE, ZERO, ZERO, scale_to_zero=False)
    assert out[PREFILL].desired == out[DECODE].desired == 1


def test_one_busy_role_keeps_the_other_up() -> None:
    busy = RoleSignals(latency_p90=1.0, queue_depth=2, ready=1)
    out = two(IDLE, busy, ZERO, ZERO, scale_to_zero=True)
    assert (out[PREFILL].desired, out[DECODE].desired) == (1, 1)
    assert "another role is serving" in out[PREFILL].reason


def test_coordinated_scale_from_zero() -> None:
    woken = RoleSignals(queue_depth=3)
    out = two(woken, RoleSignals(), ZERO, ZERO, scale_to_zero=True)
    assert (out[PREFILL].desired, out[DECODE].desired) == (1, 1)
    assert "demand while at zero" in out[PREFILL].reason


def test_from_zero_sizes_by_the_capacity_model_within_the_step() -> None:
    pol = RolePolicy(0, 20, latency_target=1.0, prior_throughput=200.0)
    assert one(pol, RoleSignals(token_rate=1000.0), scale_to_zero=True).desired == 4


def test_at_zero_without_demand_stays_at_zero() -> None:
    out = two(RoleSignals(), RoleSignals(), ZERO, ZERO, scale_to_zero=True)
    assert out[PREFILL].desired == out[DECODE].desired == 0


# --- GPU budget and ratio guard -------------------------------------------------------------

def test_gpu_budget_is_shared_across_roles() -> None:
    pre = RolePolicy(1, 10, 1.0, gpus_per_replica=1)
    dec = RolePolicy(1, 10, 0.05, gpus_per_replica=1)
    hot = RoleSignals(latency_p90=5.0, ready=1)
    out = two(hot, RoleSignals(latency_p90=0.25, ready=1), pre, dec, gpu_budget=6)
    assert (out[PREFILL].desired, out[DECODE].desired) == (3, 3)
    assert "gpu budget 6 trims to 3" in out[DECODE].reason


def test_gpu_budget_counts_gpus_per_replica() -> None:
    pre, dec = RolePolicy(1, 10, 1.0, gpus_per_replica=2), RolePolicy(1, 10, 0.05)
    out = two(RoleSignals(latency_p90=5.0, ready=1), RoleSignals(latency_p90=0.25, ready=1),
              pre, dec, gpu_budget=7)
    assert out[PREFILL].desired == 3 and out[DECODE].desired == 5  # GPU-free decode is not cut


def test_ratio_guard_trims_prefill_and_decode() -> None:
    pre, dec = RolePolicy(1, 20, 1.0), RolePolicy(1, 20, 0.05)
    out = two(RoleSignals(latency_p90=3.0, ready=2), RoleSignals(latency_p90=0.05, ready=2),
              pre, dec, ratio_bounds=(0.5, 2.0))
    assert out[PREFILL].desired == 4 and "ratio guard" in out[PREFILL].reason
    out = two(RoleSignals(latency_p90=1.0, ready=1), RoleSignals(latency_p90=0.3, ready=1),
              pre, dec, ratio_bounds=(0.5, 2.0))
    assert out[DECODE].desired == 2
    # Never below a role's minimum: prefill keeps its 3 though decode wants 1 (cap 2).
    out = two(RoleSignals(latency_p90=1.0, ready=3), RoleSignals(latency_p90=0.05, ready=1),
              RolePolicy(3, 20, 1.0), dec, ratio_bounds=(0.5, 2.0))
    assert (out[PREFILL].desired, out[DECODE].desired) == (3, 1)


# --- modes, spec, config checks, explainability ---------------------------------------------

@pytest.mark.parametrize("mode", ["External", "Disabled"])
def test_other_modes_leave_replicas_alone(mode: str) -> None:
    d = one(PRE, RoleSignals(latency_p90=9.0, ready=2, pending=1), mode=mode)
    assert (d.current, d.desired) == (3, 3) and mode in d.reason


def test_config_from_spec() -> None:
    cfg = config_from_spec(parse_spec({
        "metadata": {"name": "chat"},
        "spec": {"model": {"name": "m", "source": "s"}, "kvStore": {"managed": {}},
                 "prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}},
                             "autoscaling": {"minReplicas": 1, "maxReplicas": 4,
                                             "ttftSeconds": 0.5}},
                 "decode": {"replicas": 2, "autoscaling": {
                     "minReplicas": 0, "maxReplicas": 8, "tpotSeconds": 0.05,
                     "kvCacheUsage": 0.85}},
                 "autoscaling": {"gpuBudget": 8, "scaleToZero": True, "mode": "External"}}}))
    assert cfg.roles[PREFILL] == RolePolicy(1, 4, 0.5, None, gpus_per_replica=1)
    assert cfg.roles[DECODE] == RolePolicy(0, 8, 0.05, 0.85)
    assert (cfg.gpu_budget, cfg.scale_to_zero, cfg.mode) == (8, True, "External")
    fixed = config_from_spec(parse_spec({"metadata": {"name": "chat"},
                                         "spec": {"model": {"name": "m", "source": "s"},
                                                  "kvStore": {"managed": {}},
                                                  "decode": {"replicas": 3}}}))
    assert fixed.roles == {DECODE: RolePolicy(3, 3)}


def _decode_spec(**decode_autoscaling: Any) -> dict[str, Any]:
    return {"metadata": {"name": "chat"},
            "spec": {"model": {"name": "m", "source": "s"}, "kvStore": {"managed": {}},
                     "prefill": {"autoscaling": {"maxReplicas": 4, "ttftSeconds": 0.5,
                                                 "tokensPerSecondPerReplica": 20000}},
                     "decode": {"autoscaling": {"maxReplicas": 8, "tpotSeconds": 0.05,
                                                "kvCacheUsage": 0.8, **decode_autoscaling}},
                     "autoscaling": {"coldStartSeconds": 90}}}


def test_config_from_spec_carries_the_capacity_prior_and_cold_start() -> None:
    cfg = config_from_spec(parse_spec(_decode_spec(tokensPerSecondPerReplica=1000)))
    assert cfg.roles[PREFILL] == RolePolicy(1, 4, 0.5, None, prior_throughput=20000.0,
                                            startup_s=90.0)
    assert cfg.roles[DECODE] == RolePolicy(1, 8, 0.05, 0.8, prior_throughput=1000.0,
                                           startup_s=90.0)
    # The prior switches the capacity model on: 4000 tok/s at 80 % of 1000 tok/s per replica
    # asks for 5 replicas while latency and KV alone would hold 2.
    sig = {PREFILL: RoleSignals(latency_p90=0.5, queue_depth=1, token_rate=100, ready=1),
           DECODE: RoleSignals(latency_p90=0.05, kv_usage=0.5, queue_depth=0,
                               token_rate=4000, ready=2)}
    out, state = decide(NOW, sig, cfg, ScalingState())
    dec = next(d for d in out if d.role == DECODE)
    assert (dec.desired, dec.reason.split(";")[0]) == (5, "capacity asks for 5")
    assert "rise" in dec.inputs and state.demand[DECODE]  # startup_s > 0: rises are learned
    without = config_from_spec(parse_spec(_decode_spec()))
    assert without.roles[DECODE].prior_throughput is None
    out, _ = decide(NOW, sig, without, ScalingState())
    assert next(d for d in out if d.role == DECODE).desired == 2


@pytest.mark.parametrize("bad", [
    {"roles": {PREFILL: RolePolicy(3, 2)}},
    {"roles": {PREFILL: RolePolicy(2, 4, gpus_per_replica=2)}, "gpu_budget": 3},
    {"roles": {PREFILL: RolePolicy()}, "ratio_bounds": (2.0, 1.0)},
    {"roles": {PREFILL: RolePolicy(max_step_down=0)}},
])
def test_config_rejects_what_cannot_be_honoured(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PolicyConfig(**bad)


def test_every_decision_carries_inputs_and_reason() -> None:
    d = one(DEC, RoleSignals(latency_p90=0.1, kv_usage=0.5, token_rate=40.0, ready=2),
            role=DECODE)
    assert d.inputs["latency_p90"] == "0.1" and d.inputs["kv_watermark"] == "0.8"
    assert d.inputs["need_tpot"] == "4" and d.inputs["throughput_per_replica"] == "none"
    assert d.reason


# --- properties ------------------------------------------------------------------------------

maybe_pos = st.none() | st.floats(0.0, 50.0, allow_nan=False)
policies = st.builds(
    lambda lo, span, **kw: RolePolicy(lo, lo + span, **kw), st.integers(0, 5), st.integers(0, 8),
    latency_target=st.none() | st.floats(0.01, 5.0), kv_watermark=st.none() | st.floats(0.1, 1.0),
    gpus_per_replica=st.integers(0, 4), hysteresis=st.floats(0.0, 0.5),
    up_window_s=st.floats(0, 120), down_window_s=st.floats(0, 600),
    max_step_up=st.integers(1, 6), max_step_down=st.integers(1, 6),
    prior_throughput=st.none() | st.floats(1.0, 1000.0),
    startup_s=st.sampled_from([0.0, 30.0, 120.0]))
signals = st.builds(RoleSignals, latency_p90=maybe_pos, kv_usage=maybe_pos, queue_depth=maybe_pos,
                    token_rate=st.none() | st.floats(0.0, 1e5), throughput_per_replica=maybe_pos,
                    ready=st.integers(0, 15), starting=st.integers(0, 5), pending=st.integers(0, 5),
                    request_rate=maybe_pos)


@settings(max_examples=300, deadline=None)
@given(pre=policies, dec=policies, with_prefill=st.booleans(), extra=st.none() | st.integers(0, 20),
       ratio=st.none() | st.tuples(st.floats(0.1, 1.0), st.floats(1.0, 4.0)),
       zero=st.booleans(), steps=st.lists(st.tuples(signals, signals, st.floats(0, 200)),
                                          min_size=1, max_size=6))
def test_desired_stays_in_bounds_and_budget(
        pre: RolePolicy, dec: RolePolicy, with_prefill: bool, extra: int | None,
        ratio: tuple[float, float] | None, zero: bool,
        steps: list[tuple[RoleSignals, RoleSignals, float]]) -> None:
    roles = {PREFILL: pre, DECODE: dec} if with_prefill else {DECODE: dec}
    floor = sum(p.min_replicas * p.gpus_per_replica for p in roles.values())
    budget = None if extra is None else floor + extra
    cfg = PolicyConfig(roles, budget, ratio, zero)
    state, now = ScalingState(), 0.0
    for pre_sig, dec_sig, dt in steps:
        now += dt
        sigs = {PREFILL: pre_sig, DECODE: dec_sig}
        decisions, state = decide(now, {r: sigs[r] for r in roles}, cfg, state)
        assert {d.role for d in decisions} == set(roles)
        for d in decisions:
            assert roles[d.role].min_replicas <= d.desired <= roles[d.role].max_replicas
            assert d.reason and d.inputs
        if budget is not None:
            assert sum(d.desired * roles[d.role].gpus_per_replica for d in decisions) <= budget


@settings(max_examples=200, deadline=None)
@given(pol=policies, sig=signals)
def test_missing_metrics_never_remove_capacity(pol: RolePolicy, sig: RoleSignals) -> None:
    blind = RoleSignals(queue_depth=sig.queue_depth, ready=sig.ready, starting=sig.starting,
                        pending=sig.pending)
    if blind.queue_depth == 0:
        return  # known-idle is a real signal, not a missing one
    d = one(pol, blind)  # only pending pods, which serve nothing, may be dropped
    assert d.desired >= min(blind.ready + blind.starting, pol.max_replicas)


def test_broken_metrics_are_missing_not_data() -> None:
    pol = RolePolicy(1, 20, latency_target=1.0, down_window_s=0)
    for junk in (float("nan"), float("inf"), -1.0):
        d = one(pol, RoleSignals(latency_p90=junk, queue_depth=2, ready=3))
        assert d.desired == 3 and "ttft missing" in d.reason


def test_near_zero_throughput_does_not_overflow() -> None:
    pol = RolePolicy(1, 6, latency_target=1.0)
    sig = RoleSignals(latency_p90=1.0, token_rate=1.0, throughput_per_replica=5e-324, ready=2)
    assert one(pol, sig).desired == 6


def test_the_ratio_guard_comes_from_the_spec() -> None:
    doc = _decode_spec()
    doc["spec"]["autoscaling"]["prefillDecodeRatio"] = {"min": 0.5, "max": 2}
    assert config_from_spec(parse_spec(doc)).ratio_bounds == (0.5, 2.0)
    assert config_from_spec(parse_spec(_decode_spec())).ratio_bounds is None
    for bad in ({"min": 2, "max": 1}, {"min": 0, "max": 1}, {"max": 1}, "1:2"):
        doc["spec"]["autoscaling"]["prefillDecodeRatio"] = bad
        with pytest.raises(SpecError, match="prefillDecodeRatio"):
            parse_spec(doc)
