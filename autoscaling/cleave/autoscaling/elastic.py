"""Elastic autoscalers for the simulator: a per-role policy plus the flip planner.

The per-role counts come from the wrapped autoscaler (Cleave's policy, or the oracle's
timetable); :func:`cleave.autoscaling.flips.plan_flips` turns them into flips, new replicas and
removals. The floor (one worker serving both roles) is taken only after the load has fitted one
worker for ``hold_s`` straight, and left at the first interval it does not: leaving costs a
cold start for the second worker, so the floor is reserved for load well below one worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from cleave.autoscaling.baselines import CleaveAutoscaler, Observation, ScheduledAutoscaler
from cleave.autoscaling.flips import FlipPlan, WorkerView, plan_flips
from cleave.autoscaling.policy import FloorPolicy, PolicyConfig


class ElasticCleave(CleaveAutoscaler):
    """Cleave's policy deciding per-role counts, met by flips first (and the one-worker
    floor at low load): what ``cleave up --autoscale`` and the operator run with flips on."""

    name = "cleave"

    def __init__(self, config: PolicyConfig) -> None:
        # The floor is the policy's decision (policy.decide keeps it in its state), as in the
        # operator and cleave up; on by default here, as there.
        super().__init__(config if config.floor else replace(config, floor=FloorPolicy()))

    def plan(self, now: float, obs: Observation, desired: Mapping[str, int],
             workers: Sequence[WorkerView]) -> FlipPlan:
        return plan_flips(desired, workers, self.state.colocate)


class ElasticOracle(ScheduledAutoscaler):
    """The oracle's timetable met by the same flips and floor: ``floor`` marks the entries
    whose load fits one worker (known from the trace, like the counts)."""

    def __init__(self, times: Sequence[float], replicas: Sequence[Mapping[str, int]],
                 floor: Sequence[bool]) -> None:
        super().__init__(times, replicas)
        self.floor_at = list(floor)

    def plan(self, now: float, obs: Observation, desired: Mapping[str, int],
             workers: Sequence[WorkerView]) -> FlipPlan:
        import bisect

        i = max(bisect.bisect_right(self.times, now) - 1, 0)
        return plan_flips(desired, workers, self.floor_at[i])
