"""llm-d's SLO-aware autoscaler, ported from its guide (llm-d/llm-d,
``guides/workload-autoscaling/README.slo-aware.md``): a KEDA formula over a Prometheus signal,
driving an HPA with its ``behavior`` block. Every constant below is the guide's.

1. Signal (recording rules every 15 s): ``s_raw = max(p90 TTFT / S_ttft, p90 TPOT / S_tpot)``
   (no traffic reads 0), clamped at C = 2.0 and averaged over 45 s. Each p90 is Prometheus'
   ``histogram_quantile(0.9, sum(rate(..._bucket[1m])) by (le))`` over the EPP's per-request
   histograms (llm-d-router ``pkg/epp/metrics``): TTFT, and TPOT as each request's mean,
   ``(e2e - TTFT) / (output_tokens - 1)``, with the EPP's buckets below. The quantile is
   interpolated linearly inside a bucket, so with the TPOT buckets 20, 40, 60 ms a pool whose
   requests all run at 30 ms reads 38 ms: the signal llm-d tuned its thresholds on.
2. Desired (KEDA formula), n provisioned, r ready, credit c = r/n when 0 < r < n else 1:
   ``n + ceil(n (s c / 0.55 - 1))`` above 0.55 (credited: while pods warm it can ask below n,
   which the HPA's 180 s down window then holds), ``n - floor(n (1 - s / 0.40))`` below 0.40
   (uncredited), n between: the formula as ``plot_run.py`` of the benchmark reconstructs it.
3. HPA: clipped to [min, max]; stabilization up = min of the recommendations over 30 s, down =
   max over 180 s (the HPA's own algorithm: the current count clamped between the two);
   rate limits up max(100 %, 4 pods) per 60 s, down 1 pod per 120 s.

Where the port differs from the benchmark (docs/simulator.md): the signal is the measured p90
(the guide's fallback), not the EPP's predicted latency; the HPA's 10 % tolerance never binds
at these counts and is left out. Without the gateway's histograms (an :class:`Observation`
from elsewhere) the law reads the workers' p90s instead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from cleave.autoscaling.baselines import Observation, current
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.signals import TPOT, TTFT, Histogram, histogram_quantile

# The EPP's histogram buckets (llm-d-router pkg/epp/metrics: llm_d_epp_request_ttft_seconds and
# llm_d_epp_request_streaming_tpot_seconds; the predicted series use the same TPOT edges).
EPP_TTFT_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0,
                    5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, float("inf"))
EPP_TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15,
                    0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 2.0, float("inf"))
RATE_WINDOW_S = 60.0  # the recording rules' rate(...[1m])


@dataclass(frozen=True)
class LlmdLaw:
    clamp: float = 2.0
    smoothing_s: float = 45.0
    up: float = 0.55
    down: float = 0.40
    up_window_s: float = 30.0  # stabilization: min of the recommendations over it
    down_window_s: float = 180.0  # max over it
    up_period_s: float = 60.0  # up by at most max(100 %, 4 pods) per period
    up_pods: int = 4
    up_percent: float = 100.0
    down_period_s: float = 120.0  # down by at most 1 pod per period
    down_pods: int = 1


def formula(s: float, n: int, r: int, law: LlmdLaw) -> int:
    """The KEDA formula's desired replicas for smoothed signal ``s``."""
    if s > law.up:
        credit = r / n if 0 < r < n else 1.0
        return n + math.ceil(n * (s * credit / law.up - 1.0))
    if s < law.down:
        return n - math.floor(n * (1.0 - s / law.down))
    return n


@dataclass
class _Hpa:
    """One HPA's memory: its recommendations and its scale events."""

    recs: deque[tuple[float, int]] = field(default_factory=deque)
    events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, change)

    def decide(self, now: float, n: int, rec: int, lo: int, hi: int, law: LlmdLaw) -> int:
        rec = min(max(rec, lo), hi)
        self.recs.append((now, rec))
        while self.recs and now - self.recs[0][0] > max(law.up_window_s, law.down_window_s):
            self.recs.popleft()
        up_floor = min(r for t, r in self.recs if now - t <= law.up_window_s)
        down_ceiling = max(r for t, r in self.recs if now - t <= law.down_window_s)
        want = min(max(n, up_floor), down_ceiling)
        added = sum(d for t, d in self.events if d > 0 and now - t < law.up_period_s)
        removed = -sum(d for t, d in self.events if d < 0 and now - t < law.down_period_s)
        start_up, start_down = n - added, n + removed
        want = min(want, max(start_up + law.up_pods,
                             math.ceil(start_up * (1 + law.up_percent / 100))))
        want = max(want, start_down - law.down_pods)
        if want != n:
            self.events.append((now, want - n))
        while self.events and now - self.events[0][0] > max(law.up_period_s,
                                                            law.down_period_s):
            self.events.popleft()
        return want


class LlmdSloFormula:
    """The law for every role in ``min_replicas`` (one pool when serving is aggregated; each
    role on the same deployment-wide signal when disaggregated, as the guide's single signal)."""

    name = "llmd"

    def __init__(self, ttft_slo: float, tpot_slo: float, min_replicas: Mapping[str, int],
                 max_replicas: Mapping[str, int], law: LlmdLaw | None = None) -> None:
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.lo, self.hi = dict(min_replicas), dict(max_replicas)
        self.law = law or LlmdLaw()
        self.samples: deque[tuple[float, float]] = deque()
        self.hpa = {r: _Hpa() for r in self.lo}
        self.gateway: deque[tuple[float, Mapping[str, Histogram]]] = deque()

    def _p90s(self, now: float, obs: Observation) -> tuple[float | None, float | None]:
        """The pool's p90 TTFT and TPOT over the last minute: from the gateway's histograms
        when the observation carries them (the EPP's), else the workers' p90s."""
        if TTFT in obs.gateway and TPOT in obs.gateway:
            self.gateway.append((now, obs.gateway))
            while now - self.gateway[0][0] > RATE_WINDOW_S:
                self.gateway.popleft()
            older = self.gateway[0][1] if len(self.gateway) > 1 else None
            ttft, tpot = (histogram_quantile(0.9, older[k] if older else None, obs.gateway[k])
                          for k in (TTFT, TPOT))
            return ttft, tpot
        return (obs.signals[PREFILL].latency_p90 if PREFILL in obs.signals else None,
                obs.signals[DECODE].latency_p90 if DECODE in obs.signals else None)

    def signal(self, now: float, obs: Observation) -> float:
        ttft, tpot = self._p90s(now, obs)
        parts = [v for v in (ttft and ttft / self.ttft_slo, tpot and tpot / self.tpot_slo)
                 if v is not None]
        raw = max(parts) if parts else 0.0  # NaN / no traffic reads 0
        self.samples.append((now, min(raw, self.law.clamp)))
        while self.samples and now - self.samples[0][0] >= self.law.smoothing_s:
            self.samples.popleft()
        return sum(v for _, v in self.samples) / len(self.samples)

    def decide(self, now: float, obs: Observation) -> dict[str, tuple[int, str]]:
        s = self.signal(now, obs)
        out = {}
        for role in self.lo:
            sig = obs.signals[role]
            n = current(sig)
            rec = formula(s, n, sig.ready, self.law) if n > 0 else self.lo[role]
            want = self.hpa[role].decide(now, n, rec, self.lo[role], self.hi[role], self.law)
            out[role] = (want, f"signal {s:.2f} (up > {self.law.up}, down < {self.law.down}): "
                               f"formula {rec}, hpa {want}")
        return out
