"""Leaving the one-worker floor: the both-worker bridges the role it leaves until that role has
a ready worker of its own, without starting a replica every interval meanwhile."""

from __future__ import annotations

from cleave.autoscaling.flips import BOTH, WorkerView, plan_flips
from cleave.autoscaling.policy import DECODE, PREFILL


def w(name: str, home: str, role: str | None = None, ready: bool = True,
      load: float = 0.0) -> WorkerView:
    return WorkerView(name, home, role or home, ready, load)


BRIDGING = [w("d1", DECODE, role=BOTH, load=5), w("p2", PREFILL, ready=False)]


def test_a_bridge_counted_in_both_roles_does_not_start_a_replica_every_interval() -> None:
    # The backends count the bridge as ready in both roles, so a policy holding prefill at 2
    # (the bridge and the starting p2) asks for what is already there.
    plan = plan_flips({PREFILL: 2, DECODE: 1}, BRIDGING)
    assert plan.start == {PREFILL: 0, DECODE: 0} and plan.remove == () and plan.flips == ()
    assert plan.replicas == {PREFILL: 1, DECODE: 1}
    # One more asked is one more started; one fewer never removes the role's last worker.
    assert plan_flips({PREFILL: 3, DECODE: 1}, BRIDGING).start == {PREFILL: 1, DECODE: 0}
    assert plan_flips({PREFILL: 1, DECODE: 1}, BRIDGING).remove == ()


def test_the_bridge_is_never_removed_or_flipped_while_it_bridges() -> None:
    plan = plan_flips({PREFILL: 2, DECODE: 1}, [*BRIDGING, w("d3", DECODE, ready=False)])
    assert plan.remove == ("d3",) and plan.flips == ()


def test_the_bridge_goes_home_once_the_role_it_left_has_a_ready_worker() -> None:
    # Its home role has no other worker: it is that role's worker, not one still to start.
    plan = plan_flips({PREFILL: 1, DECODE: 1}, [w("d1", DECODE, role=BOTH), w("p2", PREFILL)])
    assert plan.flips == (("d1", DECODE),) and plan.remove == ()
    assert plan.start == {PREFILL: 0, DECODE: 0}


def test_leaving_the_floor_neither_removes_nor_restarts_what_it_started() -> None:
    """A held count through the bridge: start once, keep what starts, go home, no more."""
    desired = {PREFILL: 2, DECODE: 1}
    first = plan_flips(desired, [w("d1", DECODE, role=BOTH)])
    assert first.start == {PREFILL: 2, DECODE: 0}
    starting = [w("d1", DECODE, role=BOTH), w("p2", PREFILL, ready=False),
                w("p3", PREFILL, ready=False)]
    held = plan_flips(desired, starting)
    assert held.remove == () and held.start == {PREFILL: 0, DECODE: 0}, held
    home = plan_flips(desired, [w("d1", DECODE, role=BOTH), w("p2", PREFILL),
                                w("p3", PREFILL, ready=False)])
    assert home.flips == (("d1", DECODE),) and home.remove == ()
    assert home.start == {PREFILL: 0, DECODE: 0}, home


def test_a_both_worker_short_in_both_roles_alike_goes_home() -> None:
    """Equal shortfalls: its home role takes it (no flip away and back), the other starts one."""
    plan = plan_flips({PREFILL: 2, DECODE: 2}, [w("d1", DECODE, role=BOTH), w("p1", PREFILL),
                                                w("d2", DECODE)])
    assert plan.flips == (("d1", DECODE),) and plan.start == {PREFILL: 1, DECODE: 0}
