"""Elastic roles: the flip planner, the one-worker floor and projected-KV decode demand."""

from __future__ import annotations

from cleave.autoscaling.demand import projected_kv_replicas
from cleave.autoscaling.flips import (
    BOTH,
    WorkerView,
    plan_flips,
)
from cleave.autoscaling.floor import one_worker_fits
from cleave.autoscaling.policy import DECODE, PREFILL


def w(name: str, home: str, role: str | None = None, ready: bool = True,
      load: float = 0.0) -> WorkerView:
    return WorkerView(name, home, role or home, ready, load)


def test_a_starved_role_takes_a_worker_the_other_can_spare_instead_of_a_new_replica() -> None:
    workers = [w("p1", PREFILL), w("d1", DECODE, load=5), w("d2", DECODE, load=1)]
    plan = plan_flips({PREFILL: 2, DECODE: 1}, workers)
    assert plan.flips == (("d2", PREFILL),)  # the least loaded decode worker
    assert plan.start == {PREFILL: 0, DECODE: 0} and plan.remove == ()
    assert plan.replicas == {PREFILL: 1, DECODE: 2}  # Deployments unchanged: a flip is runtime


def test_only_what_flips_cannot_cover_starts_new_replicas() -> None:
    workers = [w("p1", PREFILL), w("d1", DECODE), w("d2", DECODE)]
    plan = plan_flips({PREFILL: 4, DECODE: 1}, workers)
    assert plan.flips == (("d2", PREFILL),) or plan.flips == (("d1", PREFILL),)
    assert plan.start == {PREFILL: 2, DECODE: 0}
    assert plan.replicas == {PREFILL: 3, DECODE: 2}


def test_a_starting_worker_counts_in_its_home_role_and_is_never_flipped() -> None:
    workers = [w("p1", PREFILL), w("d1", DECODE), w("d2", DECODE, ready=False)]
    plan = plan_flips({PREFILL: 2, DECODE: 1}, workers)
    assert plan.flips == (("d1", PREFILL),)
    workers = [w("p1", PREFILL), w("d1", DECODE, ready=False), w("d2", DECODE, ready=False)]
    plan = plan_flips({PREFILL: 2, DECODE: 1}, workers)
    assert plan.flips == () and plan.start[PREFILL] == 1


def test_a_flipped_worker_goes_home_first_and_surplus_is_removed() -> None:
    workers = [w("p1", PREFILL), w("d1", DECODE, role=PREFILL), w("d2", DECODE)]
    plan = plan_flips({PREFILL: 1, DECODE: 2}, workers)
    assert plan.flips == (("d1", DECODE),)
    plan = plan_flips({PREFILL: 1, DECODE: 1}, [w("p1", PREFILL), w("d1", DECODE, load=3),
                                                w("d2", DECODE, load=0)])
    assert plan.remove == ("d2",) and plan.replicas == {PREFILL: 1, DECODE: 1}


def test_the_floor_is_one_worker_serving_both_roles() -> None:
    workers = [w("p1", PREFILL, load=2), w("d1", DECODE, load=4)]
    plan = plan_flips({PREFILL: 1, DECODE: 1}, workers, colocate=True)
    assert plan.flips == (("d1", BOTH),) and plan.remove == ("p1",)
    assert plan.replicas == {PREFILL: 0, DECODE: 1}
    # Leaving the floor: the both-worker serves both until each role has a ready worker; the
    # role it leaves gets its own workers in full, its home role counts it (it goes back).
    plan = plan_flips({PREFILL: 2, DECODE: 1}, [w("d1", DECODE, role=BOTH)])
    assert plan.flips == () and plan.remove == ()
    assert plan.start == {PREFILL: 2, DECODE: 0} and plan.replicas == {PREFILL: 2, DECODE: 1}
    # ... then goes where it is short, or home.
    up = [w("d1", DECODE, role=BOTH), w("p2", PREFILL), w("p3", PREFILL), w("d4", DECODE)]
    plan = plan_flips({PREFILL: 3, DECODE: 1}, up)
    assert plan.flips == (("d1", PREFILL),) and sum(plan.start.values()) == 0
    plan = plan_flips({PREFILL: 2, DECODE: 1}, up)
    assert plan.flips == () and plan.remove == ("d1",)  # home is decode, which has enough
    # No ready worker yet: nothing is removed.
    plan = plan_flips({PREFILL: 1, DECODE: 1}, [w("p1", PREFILL, ready=False)], colocate=True)
    assert plan.remove == () and plan.flips == ()


def test_one_worker_fits_only_on_evidence_of_low_load() -> None:
    assert one_worker_fits(1000, 6000, 200, 5000, 0.5)
    assert not one_worker_fits(3000, 6000, 500, 5000, 0.5)
    assert not one_worker_fits(None, 6000, 200, 5000, 0.5)


def test_projected_kv_grows_decode_before_the_cache_fills() -> None:
    gib = 2**30
    # 10 req/s x 1000 outputs x 40 ms = 400 streams of 4500 tokens at 256 KiB: 440 GiB.
    n = projected_kv_replicas(10, 4000, 1000, 0.04, 256 * 1024, 100 * gib, 0.8)
    assert n == 6
    assert projected_kv_replicas(0, 4000, 1000, 0.04, 256 * 1024, 100 * gib, 0.8) == 0
    assert projected_kv_replicas(20, 4000, 1000, 0.04, 256 * 1024, 100 * gib, 0.8) == 11


def test_decide_grows_decode_on_projected_kv_while_the_cache_is_still_empty() -> None:
    from cleave.autoscaling.policy import (
        KvProjection,
        PolicyConfig,
        RolePolicy,
        RoleSignals,
        ScalingState,
        decide,
    )

    gib = 2**30
    proj = KvProjection(4000, 1000, 256 * 1024, 100 * gib)
    dec = RolePolicy(1, 8, latency_target=0.04, kv_watermark=0.8, kv_projection=proj)
    cfg = PolicyConfig({PREFILL: RolePolicy(1, 8), DECODE: dec})
    signals = {PREFILL: RoleSignals(ready=1, request_rate=10.0, queue_depth=0, token_rate=1.0),
               DECODE: RoleSignals(latency_p90=0.03, kv_usage=0.1, ready=1, queue_depth=0,
                                   token_rate=1.0)}
    decisions, _ = decide(0.0, signals, cfg, ScalingState())
    got = {d.role: d for d in decisions}
    assert got[DECODE].desired == 5  # 1 + max_step_up 4 toward the 6 the projection asks
    assert "projected kv" in got[DECODE].reason
    cfg = PolicyConfig({PREFILL: RolePolicy(1, 8), DECODE: RolePolicy(1, 8, 0.04, 0.8)})
    decisions, _ = decide(0.0, signals, cfg, ScalingState())
    assert {d.role: d.desired for d in decisions}[DECODE] == 1  # occupancy alone: no growth


def test_the_floor_is_taken_after_a_hold_and_left_at_once() -> None:
    from cleave.autoscaling.floor import floor_fits, floor_hold

    one = {PREFILL: 1, DECODE: 1}
    assert floor_fits({PREFILL: 2, DECODE: 1}, 10, 6000, 10, 5000, 0.3) is False
    assert floor_fits(one, None, 6000, 10, 5000, 0.3) is None
    assert floor_fits(one, 600, 6000, 500, 5000, 0.3) is True
    take, since = floor_hold(0.0, True, None, 300.0)
    assert not take and since == 0.0
    take, since = floor_hold(150.0, None, since, 300.0)  # unknown: the clock keeps running
    assert not take and since == 0.0
    take, since = floor_hold(300.0, True, since, 300.0)
    assert take
    assert floor_hold(315.0, None, since, 300.0) == (True, 0.0)  # a new pod's missing rate
    assert floor_hold(330.0, False, since, 300.0) == (False, None)
