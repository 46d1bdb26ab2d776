"""The autoscaler's signal registry: every figure the policy reads, defined once.

Each :class:`Signal` names the metric it reads per role (from ``cleave.common.metric_names``,
the names the runtime registers its metrics under), its PromQL for the Prometheus source, and
the reducer that computes the same figure from pods scraped directly. Both sources iterate
over :data:`SIGNALS` and hand the raw figures to :func:`assemble`, so they produce the same
:class:`~cleave.autoscaling.policy.RoleSignals` fields (``tests/operator/test_signal_registry.py``
checks both against one set of series, field for field, with a real Prometheus).

Adding a signal: a :class:`Signal` here (metric, PromQL, reducer), its field in ``RoleSignals``
if the policy reads it directly, or its use in :func:`assemble` if it feeds another. Nothing
else changes: the pod scraper, the Prometheus source and the simulator pick it up.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cleave.autoscaling.exposition import PodMetrics, Scrape, delta, quantile
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.common import metric_names as names

# Which workers' series speak for a role: a worker serving both roles (the one-worker floor)
# is load and latency of each, as the pod scraper records it.
ROLE_MATCH = {PREFILL: "prefill|both", DECODE: "decode|both"}
QUANTILE = 0.9


@dataclass(frozen=True)
class PodWindow:
    """One fresh pod's scrapes as a reducer sees them: the baseline (the latest answer at least
    a window old, else the oldest; None with one answer only), the newest, and every answer."""

    baseline: Scrape | None
    newest: PodMetrics
    newest_at: float
    answered: tuple[Scrape, ...]


@dataclass(frozen=True)
class Query:
    """What a signal's PromQL is written with: the selectors and the ranges."""

    workers: str  # {namespace=..., llmservice=..., role=~...}: the role's workers
    router: str  # the same service's router
    window: str  # 60s: the range of the rates and quantiles
    scrape_s: float  # Prometheus's scrape interval: a pair of consecutive samples


Reducer = Callable[[Sequence[PodWindow], str], float | None]
PromQL = Callable[[Query, str], str]


@dataclass(frozen=True)
class Signal:
    key: str  # a RoleSignals field, or a raw figure assemble() combines
    metrics: Mapping[str, str]  # role -> the metric it reads; roles not here lack the signal
    promql: PromQL  # (query, metric) -> the PromQL of a scalar
    reduce: Reducer  # (the role's fresh pods, or the routers; metric) -> the same figure
    router: bool = False  # read from the service's routers, not the role's workers


# --- reducers over scraped pods -----------------------------------------------------------


def sum_newest(pods: Sequence[PodWindow], metric: str) -> float | None:
    """A gauge summed over the pods' newest answers; None when no pod answered."""
    return sum(p.newest.values.get(metric, 0.0) for p in pods) if pods else None


def mean_newest(pods: Sequence[PodWindow], metric: str) -> float | None:
    values = [p.newest.values[metric] for p in pods if metric in p.newest.values]
    return sum(values) / len(values) if values else None


def windowed_quantile(pods: Sequence[PodWindow], metric: str, q: float) -> float | None:
    """``q`` of the observations in the window, bucket deltas summed over the pods."""
    bounds: tuple[float, ...] | None = None
    total: list[float] = []
    for p in pods:
        hist = p.newest.histograms.get(metric)
        if hist is None or p.baseline is None:
            continue  # one scrape is no window: wait for the next
        assert p.baseline.metrics is not None
        moved = delta(p.baseline.metrics.histograms.get(metric), hist)
        if bounds is not None and hist.bounds != bounds:
            continue
        bounds = hist.bounds
        total = [a + b for a, b in zip(total, moved, strict=True)] if total else list(moved)
    return None if bounds is None else quantile(q, bounds, tuple(total))


def latency_p90(pods: Sequence[PodWindow], metric: str) -> float | None:
    return windowed_quantile(pods, metric, QUANTILE)


def _rate(pods: Sequence[PodWindow], read: Callable[[PodMetrics], float | None]) -> float | None:
    """Growth per second of a counter over each pod's window, summed over the pods with a
    window (a counter that went down restarted: all of it is new)."""
    rate, seen = 0.0, False
    for p in pods:
        if p.baseline is None or p.newest_at <= p.baseline.at:
            continue
        assert p.baseline.metrics is not None
        now_v, then_v = read(p.newest), read(p.baseline.metrics)
        if now_v is None:
            continue
        grown = now_v if then_v is None or then_v > now_v else now_v - then_v
        rate += grown / (p.newest_at - p.baseline.at)
        seen = True
    return rate if seen else None


def counter_rate(pods: Sequence[PodWindow], metric: str) -> float | None:
    return _rate(pods, lambda m: m.values.get(metric))


def observation_rate(pods: Sequence[PodWindow], metric: str) -> float | None:
    """Observations per second of a histogram (its ``_count``)."""
    def count(m: PodMetrics) -> float | None:
        h = m.histograms.get(metric)
        return None if h is None else h.count
    return _rate(pods, count)


def saturated_rate(pods: Sequence[PodWindow], metric: str) -> float | None:
    """Best per-pod token rate between two consecutive scrapes that both found requests
    queued: a pod with a standing queue works flat out, so that rate is what one replica can
    do. (One request caught waiting at a single scrape is no saturation: at low load it would
    read the low rate as capacity and grow the role every interval.)"""
    best: float | None = None
    for p in pods:
        for a, b in itertools.pairwise(p.answered):
            assert a.metrics is not None and b.metrics is not None
            if (a.metrics.values.get(names.WAITING, 0.0) <= 0
                    or b.metrics.values.get(names.WAITING, 0.0) <= 0 or b.at <= a.at):
                continue
            grown = b.metrics.values.get(metric, 0.0) - a.metrics.values.get(metric, 0.0)
            if grown > 0:
                r = grown / (b.at - a.at)
                best = r if best is None else max(best, r)
    return best


# --- PromQL -------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _saturated_promql(q: Query, metric: str) -> str:
    # irate over a range holding the last two samples is the pair's rate; min_over_time of the
    # queue over the same range says both found requests queued; the subquery at the scrape
    # interval visits every pair of the window.
    pair = f"[{_duration(1.5 * q.scrape_s)}]"
    rate = f"sum by (instance) (irate({names.total(metric)}{q.workers}{pair})) > 0"
    queued = f"min by (instance) (min_over_time({names.WAITING}{q.workers}{pair})) > 0"
    return (f"max(max_over_time(({rate} and on (instance) ({queued}))"
            f"[{q.window}:{_duration(q.scrape_s)}]))")


LATENCY = {PREFILL: names.TTFT, DECODE: names.TPOT}
_TOKENS = {PREFILL: names.PROMPT_TOKENS, DECODE: names.GENERATION_TOKENS}
_BOTH_WAITING = {PREFILL: names.WAITING, DECODE: names.WAITING}

SIGNALS: tuple[Signal, ...] = (
    Signal("latency_p90", LATENCY,
           lambda q, m: f"histogram_quantile({QUANTILE}, sum by (le) "
                        f"(rate({names.bucket(m)}{q.workers}[{q.window}])))", latency_p90),
    Signal("kv_usage", {DECODE: names.KV_USAGE}, lambda q, m: f"avg({m}{q.workers})",
           mean_newest),
    Signal("queue_role", _BOTH_WAITING, lambda q, m: f"sum({m}{q.workers})", sum_newest),
    Signal("queue_router", _BOTH_WAITING, lambda q, m: f"sum({m}{q.router})", sum_newest,
           router=True),
    Signal("token_rate", _TOKENS,
           lambda q, m: f"sum(rate({names.total(m)}{q.workers}[{q.window}]))", counter_rate),
    Signal("throughput_per_replica", _TOKENS, _saturated_promql, saturated_rate),
    # Prefill's requests served/s (its TTFT observations) turn queue growth into demand.
    Signal("request_rate", {PREFILL: names.TTFT},
           lambda q, m: f"sum(rate({m}_count{q.workers}[{q.window}]))", observation_rate),
)


def for_role(role: str) -> tuple[Signal, ...]:
    return tuple(s for s in SIGNALS if role in s.metrics)


def assemble(raw: Mapping[str, float | None], *, ready: int, starting: int,
             pending: int) -> RoleSignals:
    """One role's :class:`RoleSignals` from its raw figures (keys of :data:`SIGNALS`; absent
    is None), whichever source computed them."""
    own, held = raw.get("queue_role"), raw.get("queue_router")
    if own is not None:
        queue: float | None = own + (held or 0.0)
    elif ready + starting == 0:
        queue = held  # at zero only the router sees demand, and that is enough to wake it
    else:
        queue = None  # replicas exist but none answered: unknown, not empty
    token_rate = raw.get("token_rate")
    if token_rate is None and own is None and ready + starting == 0 and held is not None:
        token_rate = 0.0  # nothing exists to produce tokens
    return RoleSignals(
        latency_p90=raw.get("latency_p90"), kv_usage=raw.get("kv_usage"), queue_depth=queue,
        token_rate=token_rate, throughput_per_replica=raw.get("throughput_per_replica"),
        request_rate=raw.get("request_rate"), ready=ready, starting=starting, pending=pending)
