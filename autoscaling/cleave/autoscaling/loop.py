"""The one autoscaler loop: observe, decide, act, tell — whatever runs the replicas.

Every interval a :class:`Backend` observes its replicas and their signals (:class:`Observed`),
a :class:`Decider` turns them into per-role decisions (Cleave's pure policy, or in the
simulator a baseline), and :class:`AutoscalerLoop` works out what changed
(:func:`cleave.autoscaling.report.changes`), has the backend carry it out — a flip plan first
when the roles are elastic, else one scale per role — and has it tell what was done (status,
Events, logs, metrics). Three backends implement it: the operator's Kubernetes controller
(``cleave.operator.autoscaler.controller``), ``cleave up --autoscale``
(``cleave.runtime.serving.local_autoscale``) and the simulator
(``cleave.autoscaling.simulator``).

Only what was carried out is told: a scale or a plan that failed is found again, and tried
again, at the next tick. In advisory mode nothing is carried out; a changed recommendation is
told once.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from cleave.autoscaling import report
from cleave.autoscaling.exposition import Histogram
from cleave.autoscaling.flips import FlipPlan, WorkerView, plan_flips
from cleave.autoscaling.policy import (
    Decision,
    PolicyConfig,
    RoleSignals,
    ScalingState,
    decide,
    seed,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Observed:
    """What a backend saw at one tick."""

    signals: Mapping[str, RoleSignals]
    # Per role the backend owns: what a change is measured against (Deployment replicas, or
    # workers per current role). Decisions of other roles are neither told nor acted on.
    current: Mapping[str, int]
    # Per role: replicas up, to seed a fresh policy history (none removed before a whole
    # scale-down window of new decisions agrees, as if the loop had been running all along).
    replicas: Mapping[str, int]
    # Elastic roles: every worker in its current role, for the flip planner. None: each role
    # is scaled on its own.
    workers: tuple[WorkerView, ...] | None = None
    # What the simulator's baselines read besides the signals.
    in_flight: Mapping[str, float] = field(default_factory=dict)
    gateway: Mapping[str, Histogram] = field(default_factory=dict)


class Decider(Protocol):
    @property
    def colocate(self) -> bool:
        """The one-worker floor, as last decided."""
        ...

    def decide(self, now: float, obs: Observed) -> Sequence[Decision]: ...

    def plan(self, now: float, obs: Observed, desired: Mapping[str, int]) -> FlipPlan: ...


class PolicyDecider:
    """Cleave's pure policy (:func:`cleave.autoscaling.policy.decide`), its state seeded at the
    first tick with the replicas already up."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config  # may be replaced between ticks (a spec edit)
        self.state: ScalingState | None = None

    @property
    def colocate(self) -> bool:
        return self.state is not None and self.state.colocate

    def decide(self, now: float, obs: Observed) -> Sequence[Decision]:
        if self.state is None:
            self.state = seed(now, obs.replicas)
        decisions, self.state = decide(now, obs.signals, self.config, self.state)
        return decisions

    def plan(self, now: float, obs: Observed, desired: Mapping[str, int]) -> FlipPlan:
        assert obs.workers is not None
        return plan_flips(desired, obs.workers, self.colocate)


@dataclass(frozen=True)
class Tick:
    now: float
    observed: Observed
    decisions: tuple[Decision, ...]  # of the roles the backend owns
    done: tuple[report.Change, ...]  # carried out (advisory: recommended), to be told
    plan: FlipPlan | None  # the flip plan carried out, if one was made
    status: Mapping[str, Any] | None  # the new status block when it changed, else None


class Backend(Protocol):
    async def observe(self, now: float) -> Observed | None:
        """None: nothing to decide yet (e.g. the Deployments do not exist)."""
        ...

    async def scale(self, change: report.Change, now: float) -> bool:
        """Set one role's replicas to ``change.desired``; False if that did not happen."""
        ...

    async def carry_out(self, plan: FlipPlan, now: float) -> bool:
        """Flips, starts and removals of a plan; False if any step failed."""
        ...

    async def tell(self, tick: Tick) -> None:
        """Publish a tick: status (when ``tick.status``), Events, logs, metrics."""
        ...


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class AutoscalerLoop:
    """One scaled service's loop state: what was last told, and the floor as carried out.

    ``act_every_tick``: the backend's actions are idempotent and cheap, and are repeated every
    tick whatever changed (the simulator, whose scale also places replicas that waited for
    room)."""

    def __init__(self, backend: Backend, decider: Decider, *, advisory: bool = False,
                 act_every_tick: bool = False) -> None:
        self.backend, self.decider = backend, decider
        self.advisory = advisory
        self.act_every_tick = act_every_tick
        self.told: Mapping[str, Any] | None = None  # the status block last told
        self._colocated = False

    async def tick(self, now: float) -> Tick | None:
        obs = await self.backend.observe(now)
        if obs is None:
            return None
        decisions = tuple(d for d in self.decider.decide(now, obs) if d.role in obs.current)
        if self.act_every_tick:
            found = [report.Change(d, obs.current[d.role], True) for d in decisions]
        else:
            found = report.changes(decisions, obs.current, self.told, self.advisory)
        colocate = self.decider.colocate
        # The floor changes which workers serve, not how many: a plan without a count change.
        floor_moved = colocate != self._colocated and not self.advisory
        plan = None
        if obs.workers is not None and (any(c.act for c in found) or floor_moved
                                        or self.act_every_tick):
            plan = self.decider.plan(now, obs, {d.role: d.desired for d in decisions})
            done = []
            if await self.backend.carry_out(plan, now):
                self._colocated = colocate
                done = [replace(c, decision=replace(
                    c.decision, reason=f"{c.decision.reason}; plan: {plan.reason}"))
                    for c in found]
        else:
            done = [c for c in found if not c.act or await self.backend.scale(c, now)]
        status = None
        if not self.act_every_tick and report.needs_write(self.told, done, self.advisory):
            status = report.status_block(self.told, done, {d.role: d.desired
                                                           for d in decisions},
                                         self.advisory, _stamp())
        tick = Tick(now, obs, decisions, tuple(done), plan, status)
        await self.backend.tell(tick)
        if status is not None:
            self.told = status
        return tick


def run_now(step: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits (a backend with no I/O: the simulator's) to its end,
    without an event loop."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    step.close()
    raise RuntimeError("a backend without I/O waited on something")
