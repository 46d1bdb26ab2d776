"""The Kubernetes autoscaler's pure pieces: spec options, replica ownership, pod counting, scrape
URLs, what gets published (report), the restart-safe policy seed and the operator's metrics.
(What it writes to the API server: test_autoscaler_writes.py.)"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from prometheus_client import REGISTRY
from service_support import AUTO, spec_of

from cleave.autoscaling import metrics, report
from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.policy import RoleSignals, decide, seed
from cleave.common import metric_names as names
from cleave.operator.autoscaler.controller import metrics_url
from cleave.operator.autoscaler.policy_from_spec import config_from_spec
from cleave.operator.main import run_operator
from cleave.operator.reconcile import initial_replicas, owned_replicas
from cleave.operator.spec import SpecError, parse_spec
from cleave.operator.status import count_pods

# --- spec ---------------------------------------------------------------------------------


def test_autoscaler_options_default_and_parse() -> None:
    opts = parse_spec(spec_of()).autoscaler
    assert (opts.interval_seconds, opts.window_seconds, opts.scale_down_delay_seconds,
            opts.dry_run, opts.prometheus_url) == (15.0, 60.0, 300.0, False, None)
    opts = parse_spec(spec_of(intervalSeconds=5, windowSeconds=30, scaleDownDelaySeconds=0,
                              dryRun=True, prometheus={"url": "http://prom:9090"})).autoscaler
    assert (opts.interval_seconds, opts.window_seconds, opts.scale_down_delay_seconds,
            opts.dry_run, opts.prometheus_url) == (5.0, 30.0, 0.0, True, "http://prom:9090")


@pytest.mark.parametrize(("autoscaling", "message"), [
    ({"intervalSeconds": 0}, "intervalSeconds must be a number > 0"),
    ({"windowSeconds": "1m"}, "windowSeconds must be a number > 0"),
    ({"intervalSeconds": 30, "windowSeconds": 10}, "windowSeconds 10 < intervalSeconds 30"),
    ({"scaleDownDelaySeconds": -5}, "scaleDownDelaySeconds must be a number >= 0"),
    ({"prometheus": {"url": "prom:9090"}}, r"prometheus needs an http\(s\) url"),
    ({"dryRun": "false"}, "dryRun must be true or false, got 'false'"),
    ({"coldStartSeconds": -1}, "coldStartSeconds must be a finite number >= 0, got -1"),
    ({"coldStartSeconds": "90s"}, "coldStartSeconds must be a finite number >= 0, got '90s'"),
    ({"coldStartSeconds": True}, "coldStartSeconds must be a finite number >= 0, got True"),
    ({"coldStartSeconds": float("inf")}, "coldStartSeconds must be a finite number >= 0"),
])
def test_bad_autoscaler_options_are_spec_errors(autoscaling: dict[str, Any],
                                                message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(spec_of(**autoscaling))


def test_capacity_prior_and_cold_start_parse() -> None:
    spec = parse_spec(spec_of(
        prefill={"autoscaling": {"tokensPerSecondPerReplica": 20000, "ttftSeconds": 0.5}},
        decode={"autoscaling": {"tokensPerSecondPerReplica": 1500.5}}, coldStartSeconds=90))
    assert spec.prefill is not None and spec.prefill.autoscaling is not None
    assert spec.decode.autoscaling is not None
    assert spec.prefill.autoscaling.tokens_per_second_per_replica == 20000.0
    assert spec.decode.autoscaling.tokens_per_second_per_replica == 1500.5
    assert spec.autoscaler.cold_start_seconds == 90.0
    plain = parse_spec(spec_of(decode={"autoscaling": {}}))
    assert plain.decode.autoscaling is not None
    assert plain.decode.autoscaling.tokens_per_second_per_replica is None
    assert plain.autoscaler.cold_start_seconds == 0.0
    assert parse_spec(spec_of(coldStartSeconds=0)).autoscaler.cold_start_seconds == 0.0


@pytest.mark.parametrize("value", [0, -10, "fast", False, float("nan"), float("inf"), [1]])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_bad_tokens_per_second_per_replica_is_a_spec_error(role: str, value: Any) -> None:
    block = {"autoscaling": {"tokensPerSecondPerReplica": value}}
    with pytest.raises(SpecError, match=f"spec.{role}.autoscaling.tokensPerSecondPerReplica "
                                        "must be a finite number > 0"):
        parse_spec(spec_of(prefill=block) if role == "prefill" else spec_of(decode=block))


# --- who owns replicas --------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "owned", "initial"), [
    ("Cleave", {"prefill": None, "decode": 1, "router": 1},
     {"prefill": 2, "decode": 1, "router": 1}),
    ("External", {"prefill": None, "decode": None, "router": 1},
     {"prefill": 5, "decode": 1, "router": 1}),
    ("Disabled", {"prefill": 5, "decode": 1, "router": 1},
     {"prefill": 5, "decode": 1, "router": 1}),
])
def test_replica_ownership_by_mode(mode: str, owned: dict[str, int | None],
                                   initial: dict[str, int]) -> None:
    spec = parse_spec(spec_of(AUTO, {"replicas": 1}, mode=mode))
    assert owned_replicas(spec) == owned
    assert initial_replicas(spec) == initial
    assert spec.autoscaled_roles() == (("prefill",) if mode == "Cleave" else ())


def test_an_hpa_that_targets_a_deployment_owns_its_replicas() -> None:
    """Creating an HPA (or a KEDA ScaledObject, which makes one) for any Deployment is how a
    user hands its replicas over; the others stay the operator's."""
    spec = parse_spec(spec_of(None, {"replicas": 3}, mode="Disabled"))
    name = spec.name
    assert owned_replicas(spec, {f"{name}-router", "unrelated"}) == {
        "prefill": None, "decode": 3, "router": None}
    assert owned_replicas(spec, {f"{name}-decode"})["decode"] is None


def test_initial_replicas_at_zero_only_with_scale_to_zero() -> None:
    zero = {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    assert initial_replicas(parse_spec(spec_of(zero, zero))) == {
        "prefill": 1, "decode": 1, "router": 1}
    assert initial_replicas(parse_spec(spec_of(zero, zero, scaleToZero=True))) == {
        "prefill": 0, "decode": 0, "router": 1}


# --- pods ---------------------------------------------------------------------------------


def pod(ready: bool = True, ip: str | None = "10.0.0.7", port_name: str = "http",
        unschedulable: bool = False, deleting: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": conditions}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status, "spec": {"containers": [
        {"name": "w", "ports": [{"name": "grpc", "containerPort": 9}, {
            "name": port_name, "containerPort": 8100}]}]}}


def test_count_pods() -> None:
    pods = [pod(), pod(), pod(ready=False), pod(unschedulable=True), pod(deleting=True),
            {"status": {"phase": "Failed"}}]
    assert count_pods(4, pods) == PodCounts(ready=2, starting=1, pending=1)
    # Asked for but not created yet (just scaled up): capacity on its way, not absent.
    assert count_pods(6, pods) == PodCounts(ready=2, starting=3, pending=1)
    assert count_pods(0, []) == PodCounts(0, 0, 0)


def test_count_pods_never_exceeds_the_deployments_replicas() -> None:
    # A rolling update (a reconcile changed the pod template) surges a new pod next to the
    # old ones: counting it would turn a "hold" into a scale-up at every template change.
    surge = [pod(), pod(), pod(ready=False)]
    assert count_pods(2, surge) == PodCounts(ready=2, starting=0, pending=0)
    assert count_pods(2, [pod(), pod(unschedulable=True), pod(ready=False)]) == PodCounts(
        ready=1, starting=0, pending=1)
    # Scaled down, the ReplicaSet not there yet: the Deployment's count is what is current.
    assert count_pods(1, [pod(), pod()]) == PodCounts(ready=1, starting=0, pending=0)
    for replicas in range(5):
        for pods in (surge, [pod(), pod(unschedulable=True)], []):
            c = count_pods(replicas, pods)
            assert c.ready + c.starting + c.pending == replicas


def test_a_hold_during_a_rolling_update_is_not_a_change() -> None:
    """The policy's current is ready + starting + pending; a hold must equal the Deployment's
    replicas, or report.changes would scale the surge in."""
    spec = parse_spec(spec_of(AUTO, {"replicas": 1}))
    c = count_pods(3, [pod(), pod(), pod(), pod(ready=False)])  # 3 old + 1 surge pod
    hold = RoleSignals(latency_p90=None, ready=c.ready, starting=c.starting, pending=c.pending)
    out, _ = decide(0.0, {"prefill": hold, "decode": RoleSignals(ready=1)}, config_from_spec(spec),
                    seed(0.0, {"prefill": 3, "decode": 1}))
    prefill = next(d for d in out if d.role == "prefill")
    assert prefill.desired == 3
    assert report.changes([prefill], {"prefill": 3}, None, dry_run=False) == []


def test_metrics_url_of_a_ready_pod_only() -> None:
    assert metrics_url(pod()) == "http://10.0.0.7:8100/metrics"
    assert metrics_url(pod(ip="fd00::7")) == "http://[fd00::7]:8100/metrics"
    assert metrics_url(pod(ready=False)) is None
    assert metrics_url(pod(ip=None)) is None
    assert metrics_url(pod(port_name="web")) is None


# --- restart safety -----------------------------------------------------------------------


def test_a_fresh_policy_history_delays_scale_down_but_not_scale_up() -> None:
    spec = parse_spec(spec_of(AUTO, {"replicas": 1}, scaleDownDelaySeconds=60))
    cfg = config_from_spec(spec)
    assert cfg.roles["prefill"].down_window_s == 60
    idle = RoleSignals(queue_depth=0, token_rate=0, ready=4)
    fixed = RoleSignals(latency_p90=None, ready=1)
    state = seed(100.0, {"prefill": 4, "decode": 1})
    out, state = decide(100.0, {"prefill": idle, "decode": fixed}, cfg, state)
    assert out[1].role == "prefill" and out[1].desired == 4  # held: the seed says 4
    out, _ = decide(161.0, {"prefill": idle, "decode": fixed}, cfg, state)
    assert out[1].desired == 3  # a whole delay of idle recommendations: one step down
    hot = RoleSignals(latency_p90=1.5, ready=4)  # 3x the 0.5 s target
    out, _ = decide(100.0, {"prefill": hot, "decode": fixed}, cfg, seed(100.0, {"prefill": 4}))
    assert out[1].desired == 6  # up at once (bounded by max 6)


# --- operator metrics ---------------------------------------------------------------------


def test_desired_gauge_keeps_one_series_per_role() -> None:
    labels = {"llmservice": "m1", "namespace": "ns", "role": "decode"}
    metrics.set_desired("m1", "ns", "decode", 3, advisory=True)
    metrics.set_desired("m1", "ns", "decode", 2, advisory=False)
    gauge = names.AUTOSCALER_DESIRED
    assert REGISTRY.get_sample_value(gauge, {**labels, "advisory": "false"}) == 2
    assert REGISTRY.get_sample_value(gauge, {**labels, "advisory": "true"}) is None
    metrics.count_decision("m1", "ns", "decode", "up", advisory=False)
    assert REGISTRY.get_sample_value(names.total(names.AUTOSCALER_DECISIONS), {
        **labels, "direction": "up", "advisory": "false"}) == 1
    metrics.set_desired("m1", "ns", "prefill", 1, advisory=False)
    metrics.forget("m1", "ns", keep=["prefill"])  # decode is no longer autoscaled
    assert REGISTRY.get_sample_value(gauge, {**labels, "advisory": "false"}) is None
    assert REGISTRY.get_sample_value(gauge, {**labels, "role": "prefill",
                                             "advisory": "false"}) == 1
    metrics.forget("m1", "ns")
    assert REGISTRY.get_sample_value(gauge, {**labels, "role": "prefill",
                                             "advisory": "false"}) is None


def test_bad_metrics_port_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match=r"--metrics-port must be 0\.\.65535, got 70000"):
        run_operator(argparse.Namespace(metrics_port=70000))
    monkeypatch.setenv("CLEAVE_OPERATOR_METRICS_PORT", "lots")
    with pytest.raises(SystemExit, match="CLEAVE_OPERATOR_METRICS_PORT must be a port number"):
        run_operator(argparse.Namespace(metrics_port=None))


def test_a_seeded_history_keeps_idle_replicas_for_the_whole_down_window() -> None:
    # What both backends do when their loop starts with replicas already up.
    from cleave.autoscaling.policy import PolicyConfig, RolePolicy, ScalingState

    cfg = PolicyConfig({"decode": RolePolicy(0, 2, down_window_s=60)}, scale_to_zero=True)
    idle = {"decode": RoleSignals(ready=1, queue_depth=0, token_rate=0.0)}
    [fresh], _ = decide(5.0, idle, cfg, ScalingState())
    assert fresh.desired == 0  # an empty history would drop the worker at once
    state = seed(0.0, {"decode": 1})
    for now in (5.0, 30.0, 59.0):
        [held], state = decide(now, idle, cfg, state)
        assert held.desired == 1, now
    [later], _ = decide(61.0, idle, cfg, state)
    assert later.desired == 0


def test_the_loop_runs_for_exactly_the_services_the_spec_says_are_autoscaled() -> None:
    from cleave.operator.handlers import _autoscaled

    assert _autoscaled(body=spec_of(prefill=AUTO))
    assert not _autoscaled(body=spec_of(prefill={"replicas": 2}))  # counts fixed by the user
    assert not _autoscaled(body=spec_of(prefill=AUTO, mode="External"))
    assert not _autoscaled(body=spec_of(prefill=AUTO, mode="Disabled"))
    broken = spec_of(prefill=AUTO)
    broken["spec"]["decode"] = "not an object"
    assert not _autoscaled(body=broken)  # unreadable: reported Degraded, never scaled
