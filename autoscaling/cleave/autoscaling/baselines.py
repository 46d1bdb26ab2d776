"""Autoscalers the simulator can run, behind one interface: Cleave's policy and the baselines.

Each sees only an :class:`Observation` built from scraped metrics, the same every interval, and
returns per-role desired replicas with a reason. Baselines:

- static: a fixed count per role (peak provisioning);
- scheduled: counts that change on a timetable; with a timetable made from the trace itself
  (``scenarios.oracle_schedule``) it is the oracle a policy that follows the load is measured
  against, not something a real deployment can run;
- hpa: a Kubernetes HPA per role on requests in flight per replica (tolerance 0.1, no up
  stabilization, 300 s down, up by at most max(4 pods, 100 %) per interval: the HPA defaults);
- llmd: llm-d's SLO-aware law, ported faithfully in :mod:`cleave.autoscaling.llmd`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cleave.autoscaling.exposition import Histogram
from cleave.autoscaling.flips import FlipPlan, WorkerView
from cleave.autoscaling.loop import Observed
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    Decision,
    PolicyConfig,
    RoleSignals,
    ScalingState,
    decide,
)

ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class Observation:
    signals: Mapping[str, RoleSignals]  # what cleave.autoscaling.signals computes
    in_flight: Mapping[str, float]  # running + waiting per role as scraped, router-held included
    # The gateway's cumulative per-request histograms (TTFT, and TPOT as each request's mean) as
    # scraped, where the gateway exports them (llm-d's EPP; the simulator records them).
    gateway: Mapping[str, Histogram] = field(default_factory=dict)


class Autoscaler(Protocol):
    name: str

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]: ...


def current(s: RoleSignals) -> int:
    return s.ready + s.starting + s.pending


@runtime_checkable
class Planner(Protocol):
    """An elastic autoscaler: its per-role counts met by flips first."""

    def plan(self, now: float, obs: Observation, desired: Mapping[str, int],
             workers: Sequence[WorkerView]) -> FlipPlan: ...


class AutoscalerDecider:
    """Any :class:`Autoscaler` as the decider of the one autoscaler loop
    (:mod:`cleave.autoscaling.loop`): what the simulator runs, Cleave's policy included."""

    def __init__(self, autoscaler: Autoscaler) -> None:
        self.autoscaler = autoscaler

    @property
    def colocate(self) -> bool:
        state = getattr(self.autoscaler, "state", None)
        return bool(getattr(state, "colocate", False))

    @staticmethod
    def observation(obs: Observed) -> Observation:
        return Observation(obs.signals, obs.in_flight, obs.gateway)

    def decide(self, now: float, obs: Observed) -> list[Decision]:
        out = self.autoscaler.decide(now, self.observation(obs))
        return [Decision(r, current(obs.signals[r]), *out[r], {}) for r in ROLES if r in out]

    def plan(self, now: float, obs: Observed, desired: Mapping[str, int]) -> FlipPlan:
        assert isinstance(self.autoscaler, Planner) and obs.workers is not None
        return self.autoscaler.plan(now, self.observation(obs), desired, obs.workers)


class CleaveAutoscaler:
    name = "cleave"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.state = ScalingState()

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        decisions, self.state = decide(now, obs.signals, self.config, self.state)
        return {d.role: (d.desired, d.reason) for d in decisions}


class StaticAutoscaler:
    name = "static"

    def __init__(self, replicas: Mapping[str, int]) -> None:
        self.replicas = dict(replicas)

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        return {r: (n, "static") for r, n in self.replicas.items()}


class ScheduledAutoscaler:
    name = "oracle"

    def __init__(self, times: Sequence[float], replicas: Sequence[Mapping[str, int]]) -> None:
        if len(times) != len(replicas) or not times:
            raise ValueError("need one replica count per time, and at least one")
        self.times = list(times)
        self.replicas = [dict(r) for r in replicas]

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        i = max(bisect.bisect_right(self.times, now) - 1, 0)
        return {r: (n, "scheduled") for r, n in self.replicas[i].items()}


@dataclass
class _Stabilizer:
    """HPA stabilization: up to the lowest recommendation of the up window, down to the
    highest of the down window."""

    up_window_s: float
    down_window_s: float
    history: list[tuple[float, int]] = field(default_factory=list)

    def __call__(self, now: float, cur: int, rec: int) -> int:
        if not self.history and rec < cur:  # going down, the count it found counts too
            self.history.append((now, cur))
        keep = max(self.up_window_s, self.down_window_s)
        self.history = [(t, n) for t, n in self.history if now - t <= keep] + [(now, rec)]
        if rec > cur:
            return max(cur, min(n for t, n in self.history if now - t <= self.up_window_s))
        if rec < cur:
            return min(cur, max(n for t, n in self.history if now - t <= self.down_window_s))
        return cur


def _hpa_limits(cur: int, want: int, lo: int, hi: int) -> int:
    want = min(want, cur + max(4, cur))  # HPA default scale-up policy per period
    return min(max(want, lo), hi)


class HpaConcurrency:
    """HPA on the average requests in flight per replica of each role."""

    name = "hpa"

    def __init__(self, targets: Mapping[str, float], min_replicas: Mapping[str, int],
                 max_replicas: Mapping[str, int], tolerance: float = 0.1,
                 up_window_s: float = 0.0, down_window_s: float = 300.0) -> None:
        self.targets, self.lo, self.hi = dict(targets), dict(min_replicas), dict(max_replicas)
        self.tolerance = tolerance
        self.stab = {r: _Stabilizer(up_window_s, down_window_s) for r in targets}

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        out = {}
        for r, target in self.targets.items():
            s = obs.signals[r]
            cur, ready = current(s), s.ready
            load = obs.in_flight.get(r)
            if load is None or (ready == 0 and load == 0):
                out[r] = (max(cur, self.lo[r]), "hold: no metric")
                continue
            per = load / max(ready, 1)
            ratio = per / target
            rec = cur if abs(ratio - 1) <= self.tolerance else math.ceil(max(ready, 1) * ratio)
            want = _hpa_limits(cur, self.stab[r](now, cur, rec), self.lo[r], self.hi[r])
            out[r] = (want, f"in flight {per:.1f}/replica vs target {target:g}: {want}")
        return out
