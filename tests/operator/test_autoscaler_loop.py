"""The one autoscaler loop (``cleave.autoscaling.loop``) against a recording backend: what it acts
on, what it tells, what it retries, and the simulator's act-every-tick mode. The Kubernetes and
local backends run it end to end in test_autoscaler_k8s.py and tests/runtime/."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import pytest

from cleave.autoscaling import report
from cleave.autoscaling.flips import FlipPlan, WorkerView
from cleave.autoscaling.loop import AutoscalerLoop, Observed, PolicyDecider, Tick, run_now
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    Decision,
    FloorPolicy,
    PolicyConfig,
    RolePolicy,
    RoleSignals,
)


class Recorder:
    """A backend that observes what it is told to and records every call."""

    def __init__(self, current: Mapping[str, int], workers: tuple[WorkerView, ...] | None = None,
                 fail: Sequence[str] = ()) -> None:
        self.current, self.workers, self.fail = dict(current), workers, set(fail)
        self.scaled: list[tuple[str, int]] = []
        self.plans: list[FlipPlan] = []
        self.told: list[Tick] = []

    async def observe(self, now: float) -> Observed:
        signals = {r: RoleSignals(ready=n) for r, n in self.current.items()}
        return Observed(signals, dict(self.current), dict(self.current), self.workers)

    async def scale(self, change: report.Change, now: float) -> bool:
        if change.role in self.fail:
            return False
        self.scaled.append((change.role, change.desired))
        self.current[change.role] = change.desired
        return True

    async def carry_out(self, plan: FlipPlan, now: float) -> bool:
        self.plans.append(plan)
        return "plan" not in self.fail

    async def tell(self, tick: Tick) -> None:
        self.told.append(tick)


class Wants:
    """A decider asking for set counts, and the floor when ``colocate``."""

    def __init__(self, desired: Mapping[str, int], colocate: bool = False) -> None:
        self.desired, self.colocate = dict(desired), colocate

    def decide(self, now: float, obs: Observed) -> list[Decision]:
        return [Decision(r, obs.current.get(r, 0), n, f"{r} wants {n}", {})
                for r, n in self.desired.items()]

    def plan(self, now: float, obs: Observed, desired: Mapping[str, int]) -> FlipPlan:
        return FlipPlan((), {}, (), dict(desired), "planned")


def test_acts_on_changes_tells_only_what_was_done_and_retries_a_failed_scale() -> None:
    backend = Recorder({PREFILL: 1, DECODE: 1}, fail=[DECODE])
    loop = AutoscalerLoop(backend, Wants({PREFILL: 2, DECODE: 3}))
    tick = run_now(loop.tick(0.0))
    assert backend.scaled == [(PREFILL, 2)]
    assert [(c.role, c.desired) for c in tick.done] == [(PREFILL, 2)]
    assert tick.status is not None and tick.status["desiredReplicas"] == {PREFILL: 2, DECODE: 3}
    assert [d["role"] for d in tick.status["decisions"]] == [PREFILL]  # decode not claimed
    backend.fail.clear()
    again = run_now(loop.tick(1.0))
    assert backend.scaled == [(PREFILL, 2), (DECODE, 3)]  # prefill is not scaled twice
    assert [(c.role, c.desired) for c in again.done] == [(DECODE, 3)]
    quiet = run_now(loop.tick(2.0))
    assert quiet.done == () and quiet.status is None  # nothing changed: nothing written


def test_advisory_acts_on_nothing_and_tells_a_standing_recommendation_once() -> None:
    backend = Recorder({DECODE: 1})
    loop = AutoscalerLoop(backend, Wants({DECODE: 2}), advisory=True)
    ticks = [run_now(loop.tick(t)) for t in (0.0, 1.0, 2.0)]
    assert backend.scaled == [] and backend.plans == []
    assert [len(t.done) for t in ticks] == [1, 0, 0]
    assert not ticks[0].done[0].act and ticks[0].status is not None
    assert ticks[0].status["dryRun"] is True


def test_a_role_the_backend_does_not_own_is_neither_told_nor_acted_on() -> None:
    backend = Recorder({DECODE: 1})  # prefill is someone else's: not in current
    tick = run_now(AutoscalerLoop(backend, Wants({PREFILL: 4, DECODE: 2})).tick(0.0))
    assert [d.role for d in tick.decisions] == [DECODE] and backend.scaled == [(DECODE, 2)]


WORKERS = (WorkerView("w-1", PREFILL, PREFILL, True), WorkerView("w-2", DECODE, DECODE, True))


def test_elastic_roles_are_met_by_one_plan_retried_whole_when_it_fails() -> None:
    backend = Recorder({PREFILL: 1, DECODE: 1}, WORKERS, fail=["plan"])
    loop = AutoscalerLoop(backend, Wants({PREFILL: 2, DECODE: 1}))
    first = run_now(loop.tick(0.0))
    assert len(backend.plans) == 1 and backend.scaled == []  # no scale beside the plan
    assert first.done == () and first.status is None  # a failed plan is not told
    backend.fail.clear()
    second = run_now(loop.tick(1.0))
    assert len(backend.plans) == 2
    [change] = second.done
    assert change.decision.reason == "prefill wants 2; plan: planned"


@pytest.mark.parametrize("advisory", [False, True])
def test_the_floor_moving_is_planned_without_a_count_change_unless_advisory(
        advisory: bool) -> None:
    backend = Recorder({PREFILL: 1, DECODE: 1}, WORKERS)
    decider = Wants({PREFILL: 1, DECODE: 1}, colocate=True)
    loop = AutoscalerLoop(backend, decider, advisory=advisory)
    run_now(loop.tick(0.0))
    run_now(loop.tick(1.0))
    # Acting: planned once, then carried out (no second plan); advisory: never.
    assert len(backend.plans) == (0 if advisory else 1)


def test_act_every_tick_repeats_every_decision_and_writes_no_status() -> None:
    backend = Recorder({PREFILL: 1, DECODE: 2})
    loop = AutoscalerLoop(backend, Wants({PREFILL: 1, DECODE: 2}), act_every_tick=True)
    ticks = [run_now(loop.tick(t)) for t in (0.0, 1.0)]
    assert backend.scaled == [(PREFILL, 1), (DECODE, 2)] * 2
    assert all(t.status is None for t in ticks)


def test_policy_decider_seeds_its_history_with_the_replicas_up() -> None:
    config = PolicyConfig({DECODE: RolePolicy(1, 4, down_window_s=60.0)},
                          floor=FloorPolicy(hold_s=60.0))
    decider = PolicyDecider(config)
    backend = Recorder({DECODE: 3})
    run_now(AutoscalerLoop(backend, decider).tick(100.0))
    assert decider.state is not None and decider.state.history[DECODE][0][1] == 3
    assert backend.scaled == []  # idle, but no scale-down before a whole window agrees


def test_run_now_runs_a_backend_without_io_and_refuses_one_that_waits() -> None:
    async def ready() -> int:
        return 7

    class Later:
        """What real I/O awaits: a result to come, the event loop to be asked for it."""

        def __await__(self) -> Generator[None, None, None]:
            yield

    async def waits() -> None:
        await Later()

    assert run_now(ready()) == 7
    with pytest.raises(RuntimeError, match="waited"):
        run_now(waits())
