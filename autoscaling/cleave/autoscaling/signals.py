"""Autoscaler signals: from scraped Prometheus text to the policy's :class:`RoleSignals`.

Workers export cumulative histograms and counters; the autoscaler needs what happened *recently*.
So every pod is scraped each interval, and windowed figures come from the difference between its
newest scrape and the one a window earlier (bucket deltas, as Prometheus' ``histogram_quantile``
over ``rate()`` does). Everything but :func:`scrape` is pure, so both scale backends (the
operator and ``cleave up --autoscale``) and the tests share one implementation.

A pod that fails to answer, or answered too long ago, is *stale*: it contributes nothing. Missing
data is ``None`` all the way into the policy, which holds rather than reading it as zero latency.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.common import metric_names as names

ROUTER = "router"
# The families the autoscaler reads, under the names the runtime registers them by.
TTFT = names.TTFT
TPOT = names.TPOT
KV_USAGE = names.KV_USAGE
WAITING = names.WAITING
PROMPT_TOKENS = names.PROMPT_TOKENS
GENERATION_TOKENS = names.GENERATION_TOKENS

# Which latency histogram and which token counter speak for each role's load.
_LATENCY = {PREFILL: TTFT, DECODE: TPOT}
_TOKENS = {PREFILL: PROMPT_TOKENS, DECODE: GENERATION_TOKENS}


@dataclass(frozen=True)
class Histogram:
    """One histogram family, summed over its label sets; ``cumulative`` as exported."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    total: float


@dataclass(frozen=True)
class PodMetrics:
    histograms: Mapping[str, Histogram]
    values: Mapping[str, float]  # gauges and counters (family name, no ``_total``), summed
    roles: frozenset[str]


def parse_metrics(text: str) -> PodMetrics:
    """Parse Prometheus text exposition; ValueError if it is not that."""
    buckets: dict[str, dict[float, float]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    values: dict[str, float] = {}
    roles: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, … on garbage
        raise ValueError(f"not Prometheus text: {e}") from e
    for family in families:
        for sample in family.samples:
            if "role" in sample.labels:
                roles.add(sample.labels["role"])
            if family.type == "histogram":
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    per = buckets.setdefault(family.name, {})
                    per[le] = per.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[family.name] = counts.get(family.name, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    sums[family.name] = sums.get(family.name, 0.0) + sample.value
            elif family.type in ("gauge", "counter", "untyped") and not sample.name.endswith(
                    "_created"):
                values[family.name] = values.get(family.name, 0.0) + sample.value
    histograms = {
        name: Histogram(tuple(sorted(per)), tuple(per[b] for b in sorted(per)),
                        counts.get(name, 0.0), sums.get(name, 0.0))
        for name, per in buckets.items()}
    return PodMetrics(histograms, values, frozenset(roles))


def _delta(older: Histogram | None, newer: Histogram) -> tuple[float, ...]:
    """Per-bucket cumulative counts observed between two scrapes; a reset (the pod restarted)
    or no older scrape means everything since the process started."""
    if older is None or older.bounds != newer.bounds or older.count > newer.count:
        return newer.cumulative
    return tuple(n - o for n, o in zip(newer.cumulative, older.cumulative, strict=True))


def _quantile(q: float, bounds: tuple[float, ...], cumulative: tuple[float, ...]) -> float | None:
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    lower, below = 0.0, 0.0
    for bound, upto in zip(bounds, cumulative, strict=True):
        if upto >= rank:
            if math.isinf(bound):  # past the last finite bucket: its bound is all we know
                return lower
            inside = upto - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, upto
    return lower


def histogram_quantile(q: float, older: Histogram | None, newer: Histogram) -> float | None:
    """Quantile of the observations made between two scrapes; None if there were none."""
    return _quantile(q, newer.bounds, _delta(older, newer))


def _count_of(name: str) -> Callable[[PodMetrics], float | None]:
    def read(m: PodMetrics) -> float | None:
        h = m.histograms.get(name)
        return None if h is None else h.count
    return read


@dataclass(frozen=True)
class _Scrape:
    at: float
    metrics: PodMetrics | None  # None: the pod did not answer


class SignalCollector:
    """Per-pod scrape history, turned into per-role windowed signals on demand."""

    def __init__(self, window_s: float = 60.0, stale_after_s: float = 30.0) -> None:
        if window_s <= 0 or stale_after_s <= 0:
            raise ValueError("window_s and stale_after_s must be > 0")
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self._pods: dict[str, tuple[str, deque[_Scrape]]] = {}

    def record(self, pod: str, role: str, now: float, metrics: PodMetrics | None) -> None:
        role = DECODE if role == "both" else role
        _, history = self._pods.setdefault(pod, (role, deque()))
        self._pods[pod] = (role, history)
        history.append(_Scrape(now, metrics))
        # Keep the newest *answered* scrape at least a window old: it is the baseline of the
        # windowed delta (a failed scrape after it must not push it out). Older ones, and failed
        # scrapes before it, carry nothing.
        old = [i for i, s in enumerate(history)
               if s.metrics is not None and s.at <= now - self.window_s]
        for _ in range(old[-1] if old else 0):
            history.popleft()

    def forget(self, live_pods: Iterable[str]) -> None:
        live = set(live_pods)
        for pod in [p for p in self._pods if p not in live]:
            del self._pods[pod]

    def _fresh(self, role: str, now: float) -> list[tuple[_Scrape | None, _Scrape, list[_Scrape]]]:
        """(baseline, newest, answered scrapes) of each pod of ``role`` whose newest answer is
        recent; the baseline is the latest answer at least a window old, else the oldest one."""
        out = []
        for pod_role, history in self._pods.values():
            answered = [s for s in history if s.metrics is not None]
            if pod_role != role or not answered or now - answered[-1].at > self.stale_after_s:
                continue
            if history[-1].metrics is None:  # its latest scrape failed: stale, however recent
                continue
            newest = answered[-1]
            old = [s for s in answered[:-1] if s.at <= now - self.window_s]
            baseline = old[-1] if old else (answered[0] if len(answered) > 1 else None)
            out.append((baseline, newest, answered))
        return out

    def quantile(self, role: str, q: float, now: float) -> float | None:
        name = _LATENCY.get(role)
        bounds: tuple[float, ...] | None = None
        total: list[float] = []
        for baseline, newest, _ in self._fresh(role, now):
            assert newest.metrics is not None
            hist = newest.metrics.histograms.get(name or "")
            if hist is None or baseline is None:
                continue  # one scrape is no window: wait for the next
            assert baseline.metrics is not None
            delta = _delta(baseline.metrics.histograms.get(name or ""), hist)
            if bounds is not None and hist.bounds != bounds:
                continue
            bounds = hist.bounds
            total = [a + b for a, b in zip(total, delta, strict=True)] if total else list(delta)
        return None if bounds is None else _quantile(q, bounds, tuple(total))

    @staticmethod
    def _rate(read: Callable[[PodMetrics], float | None],
              fresh: list[tuple[_Scrape | None, _Scrape, list[_Scrape]]]) -> float | None:
        """Growth per second of a counter ``read`` from each pod's metrics, summed over the
        pods with a window (a counter that went down restarted: all of it is new)."""
        rate, seen = 0.0, False
        for baseline, newest, _ in fresh:
            if baseline is None or newest.at <= baseline.at:
                continue
            assert baseline.metrics is not None and newest.metrics is not None
            now_v, then_v = read(newest.metrics), read(baseline.metrics)
            if now_v is None:
                continue
            grown = now_v if then_v is None or then_v > now_v else now_v - then_v
            rate += grown / (newest.at - baseline.at)
            seen = True
        return rate if seen else None

    def _saturated_rate(self, name: str,
                        fresh: list[tuple[_Scrape | None, _Scrape, list[_Scrape]]]
                        ) -> float | None:
        """Best per-pod token rate over an interval that began and ended with requests queued:
        a pod with a standing queue works flat out, so that rate is what one replica can do.
        (One request caught waiting at a single scrape is no saturation: at low load it would
        read the low rate as capacity and grow the role every interval.)"""
        best: float | None = None
        for _, _, answered in fresh:
            for a, b in itertools.pairwise(answered):
                assert a.metrics is not None and b.metrics is not None
                if (a.metrics.values.get(WAITING, 0.0) <= 0
                        or b.metrics.values.get(WAITING, 0.0) <= 0 or b.at <= a.at):
                    continue
                grown = b.metrics.values.get(name, 0.0) - a.metrics.values.get(name, 0.0)
                if grown > 0:
                    r = grown / (b.at - a.at)
                    best = r if best is None else max(best, r)
        return best

    def role_signals(self, role: str, now: float, *, ready: int, starting: int,
                     pending: int) -> RoleSignals:
        fresh = self._fresh(role, now)
        routers = self._fresh(ROUTER, now)
        held = sum((n.metrics.values.get(WAITING, 0.0) if n.metrics else 0.0)
                   for _, n, _ in routers)
        if fresh:
            queue: float | None = held + sum(
                (n.metrics.values.get(WAITING, 0.0) if n.metrics else 0.0) for _, n, _ in fresh)
        elif ready + starting == 0 and routers:
            queue = held  # at zero only the router sees demand, and that is enough to wake it
        else:
            queue = None  # replicas exist but none answered: unknown, not empty
        kv = None
        if role == DECODE:
            usages = [n.metrics.values[KV_USAGE] for _, n, _ in fresh
                      if n.metrics and KV_USAGE in n.metrics.values]
            kv = sum(usages) / len(usages) if usages else None
        tokens = _TOKENS.get(role, "")
        token_rate = self._rate(lambda m: m.values.get(tokens), fresh)
        if token_rate is None and not fresh and ready + starting == 0 and routers:
            token_rate = 0.0  # nothing exists to produce tokens
        return RoleSignals(
            latency_p90=self.quantile(role, 0.9, now), kv_usage=kv, queue_depth=queue,
            token_rate=token_rate, throughput_per_replica=self._saturated_rate(tokens, fresh),
            # Prefill's requests served/s (its TTFT observations) turn queue growth into demand.
            request_rate=self._rate(_count_of(TTFT), fresh) if role == PREFILL else None,
            ready=ready, starting=starting, pending=pending)


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float) -> PodMetrics | None:
    """One pod's ``/metrics``; None on any failure, which the collector records as stale."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Target:
    """One ``/metrics`` endpoint of a scale backend: a pod, or a ``cleave up`` process."""

    name: str  # unique among the targets: the collector's key for its history
    role: str  # prefill, decode, both or router
    url: str  # the full URL of its /metrics


async def collect(collector: SignalCollector, session: aiohttp.ClientSession,
                  targets: Sequence[Target], counts: Mapping[str, PodCounts], now: float,
                  timeout_s: float) -> dict[str, RoleSignals]:
    """One interval of either scale backend: scrape every target at once (each bounded by
    ``timeout_s``), record the answers (a failure as stale data), forget what is no longer a
    target, and return the signals of each role in ``counts`` with its replica counts."""
    answers = await asyncio.gather(*(scrape(session, t.url, timeout_s) for t in targets))
    names = []
    for target, answer in zip(targets, answers, strict=True):
        # A worker serving both roles (the one-worker floor) is both roles' load and latency:
        # recorded under each, so the policy sees prefill demand with no prefill worker up.
        views = ((target.name, target.role),) if target.role != "both" or PREFILL not in counts \
            else ((f"{target.name}/{PREFILL}", PREFILL), (f"{target.name}/{DECODE}", DECODE))
        for name, role in views:
            collector.record(name, role, now, answer)
            names.append(name)
    collector.forget(names)
    return {role: collector.role_signals(role, now, ready=c.ready, starting=c.starting,
                                         pending=c.pending) for role, c in counts.items()}
