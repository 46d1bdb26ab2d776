"""What a simulation is configured with and what it produces: per-request outcomes, replica
time per role, and one sample per autoscaler interval for the timeline."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cleave.autoscaling.baselines import ROLES
from cleave.autoscaling.costmodel import CostModel
from cleave.autoscaling.policy import PREFILL
from cleave.autoscaling.simreplicas import INF, SimRequest
from cleave.autoscaling.simworker import EngineConfig

# A decode step with its prefill chunk stays within this share of the TPOT SLO, and the policy's
# TPOT target is the same step time (scenarios: latency_target), leaving the rest for batch
# growth and warmup.
DECODE_STEP_SHARE = 0.8


@dataclass(frozen=True)
class SimConfig:
    cost: CostModel
    ttft_slo: float = 2.0
    tpot_slo: float = 0.05
    cold_start_s: float = 90.0
    interval_s: float = 15.0
    metrics_window_s: float = 60.0
    initial: tuple[int, int] = (1, 1)  # (prefill, decode) replicas ready at t = 0
    cluster_gpus: int | None = None  # past it new pods stay pending
    drain_limit_s: float = 900.0  # after the trace; requests unfinished then count as misses
    engine: EngineConfig = field(default_factory=EngineConfig)
    flip_s: float = 5.0  # a live role flip: drain the old role's intake, reconfigure, announce
    scrape_lag_s: float = 5.0  # age of the metrics a decision reads (scrape, rule evaluation)
    convertible: bool = True  # the router's convertible rules (issue 18; routing.py)
    router_ttft_target: float = 2.0  # the router's --ttft-target for the backlog rule
    # When a worker becomes ready, route again the prompts queued on the others that have not
    # started and can still meet the router's TTFT target. Off: Cleave's router does not do it
    # (docs/simulator.md says how it could, and what it buys here: nothing measurable).
    redispatch: bool = False
    aggregated: bool = False  # every worker serves both phases (vLLM-style), one pool

    def gpus(self, role: str) -> int:
        return self.cost.prefill_tp if role == PREFILL else self.cost.decode_tp

    def decode_step_s(self) -> float:
        """The step time a decode worker's per-step token budget is sized for."""
        return DECODE_STEP_SHARE * self.tpot_slo

    def decode_budget(self) -> int:
        """A decode worker's per-step token budget: the engine's, else sized so that a step
        carrying a prefill chunk stays within :meth:`decode_step_s`."""
        return self.engine.decode_budget or self.cost.chunk_budget(self.decode_step_s())


@dataclass(frozen=True)
class Sample:
    t: float
    load: float  # arrivals/s over the last interval
    ready: tuple[int, int]  # (prefill, decode)
    starting: tuple[int, int]
    gpus: int
    ttft_p90: float | None  # client-side, of requests that got their first token this interval
    tpot_p90: float | None  # of requests that finished this interval
    desired: tuple[int, int]


@dataclass
class SimResult:
    policy: str
    trace: str
    duration: float
    config: SimConfig
    requests: list[SimRequest]
    replica_seconds: dict[str, float]
    samples: list[Sample] = field(default_factory=list)
    reasons: list[tuple[float, str, int, str]] = field(default_factory=list)
    flips: int = 0
    paths: dict[str, int] = field(default_factory=dict)  # requests per router path
    redispatched: int = 0  # queued prompts routed again when a worker became ready

    def avg_replicas(self) -> float:
        """Time-averaged replicas over the trace, starting and draining ones included."""
        return sum(self.replica_seconds.values()) / self.duration if self.duration else 0.0

    def attained(self, r: SimRequest) -> bool:
        return r.ttft <= self.config.ttft_slo and r.tpot <= self.config.tpot_slo

    def _share(self, ok: Callable[[SimRequest], bool]) -> float:
        return sum(map(ok, self.requests)) / len(self.requests) if self.requests else 1.0

    def slo_attainment(self) -> float:
        """Share of requests that met both the TTFT and the TPOT target."""
        return self._share(self.attained)

    def llmd_attainment(self) -> float:
        """llm-d's score (its benchmark's plot_run.py): 1 - (TTFT violations + TPOT violations)
        / requests, from the EPP's per-type counters, so a request missing both counts twice."""
        if not self.requests:
            return 1.0
        cfg = self.config
        missed = sum((r.ttft > cfg.ttft_slo) + (r.tpot > cfg.tpot_slo) for r in self.requests)
        return 1.0 - missed / len(self.requests)

    def ttft_attainment(self) -> float:
        return self._share(lambda r: r.ttft <= self.config.ttft_slo)

    def tpot_attainment(self) -> float:
        return self._share(lambda r: r.tpot <= self.config.tpot_slo)

    def gpu_hours(self) -> float:
        return sum(s * self.config.gpus(r) for r, s in self.replica_seconds.items()) / 3600

    def summary(self) -> dict[str, object]:
        cfg = self.config
        return {
            "policy": self.policy, "trace": self.trace, "duration_s": self.duration,
            "requests": len(self.requests),
            "finished": sum(r.t_done < INF for r in self.requests),
            "slo_attainment": round(self.slo_attainment(), 4),
            "ttft_attainment": round(self.ttft_attainment(), 4),
            "tpot_attainment": round(self.tpot_attainment(), 4),
            "ttft_p90_s": p90([r.ttft for r in self.requests]),
            "tpot_p90_s": p90([r.tpot for r in self.requests]),
            "replica_hours": {r: round(s / 3600, 3) for r, s in self.replica_seconds.items()},
            "gpu_hours": round(self.gpu_hours(), 3),
            "avg_replicas": round(self.avg_replicas(), 3), "flips": self.flips,
            "paths": dict(self.paths),
            "max_replicas": {r: max((s.ready[i] + s.starting[i] for s in self.samples),
                                    default=0) for i, r in enumerate(ROLES)},
            "ttft_slo_s": cfg.ttft_slo, "tpot_slo_s": cfg.tpot_slo,
            "cold_start_s": cfg.cold_start_s, "model": cfg.cost.describe(),
        }


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]
    return round(v, 4) if math.isfinite(v) else v
