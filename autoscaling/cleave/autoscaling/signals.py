"""Autoscaler signals from pods scraped directly: scraped Prometheus text to :class:`RoleSignals`.

Workers export cumulative histograms and counters; the autoscaler needs what happened *recently*.
So every pod is scraped each interval, and windowed figures come from the difference between its
newest scrape and the one a window earlier (bucket deltas, as Prometheus' ``histogram_quantile``
over ``rate()`` does). Which figures, from which metrics, reduced how, is the signal registry's
(:mod:`cleave.autoscaling.registry`), shared with the Prometheus source. Everything but
:func:`scrape` is pure, so every backend of the one autoscaler loop (the operator, ``cleave up
--autoscale``, the simulator) and the tests share one implementation.

A pod that fails to answer, or answered too long ago, is *stale*: it contributes nothing. Missing
data is ``None`` all the way into the policy, which holds rather than reading it as zero latency.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from cleave.autoscaling import registry
from cleave.autoscaling.exposition import (
    Histogram,
    PodMetrics,
    Scrape,
    histogram_quantile,
    parse_metrics,
)
from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.common import metric_names as names

__all__ = ["GENERATION_TOKENS", "KV_USAGE", "PROMPT_TOKENS", "ROUTER", "TPOT", "TTFT",
           "WAITING", "Histogram", "PodMetrics", "SignalCollector", "Target", "collect",
           "histogram_quantile", "parse_metrics", "scrape"]

ROUTER = "router"
# The families the autoscaler reads, under the names the runtime registers them by.
TTFT = names.TTFT
TPOT = names.TPOT
KV_USAGE = names.KV_USAGE
WAITING = names.WAITING
PROMPT_TOKENS = names.PROMPT_TOKENS
GENERATION_TOKENS = names.GENERATION_TOKENS


class SignalCollector:
    """Per-pod scrape history, turned into per-role windowed signals on demand."""

    def __init__(self, window_s: float = 60.0, stale_after_s: float = 30.0) -> None:
        if window_s <= 0 or stale_after_s <= 0:
            raise ValueError("window_s and stale_after_s must be > 0")
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self._pods: dict[str, tuple[str, deque[Scrape]]] = {}

    def record(self, pod: str, role: str, now: float, metrics: PodMetrics | None) -> None:
        role = DECODE if role == "both" else role
        _, history = self._pods.setdefault(pod, (role, deque()))
        self._pods[pod] = (role, history)
        history.append(Scrape(now, metrics))
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

    def fresh(self, role: str, now: float) -> list[registry.PodWindow]:
        """The window of each pod of ``role`` whose newest answer is recent; the baseline is
        the latest answer at least a window old, else the oldest one."""
        out = []
        for pod_role, history in self._pods.values():
            answered = tuple(s for s in history if s.metrics is not None)
            if pod_role != role or not answered or now - answered[-1].at > self.stale_after_s:
                continue
            if history[-1].metrics is None:  # its latest scrape failed: stale, however recent
                continue
            newest = answered[-1]
            assert newest.metrics is not None
            old = [s for s in answered[:-1] if s.at <= now - self.window_s]
            baseline = old[-1] if old else (answered[0] if len(answered) > 1 else None)
            out.append(registry.PodWindow(baseline, newest.metrics, newest.at, answered))
        return out

    def quantile(self, role: str, q: float, now: float) -> float | None:
        """``q`` of the role's latency histogram (TTFT or TPOT) over the window."""
        metric = registry.LATENCY.get(role)
        return None if metric is None else registry.windowed_quantile(
            self.fresh(role, now), metric, q)

    def raw(self, role: str, now: float) -> dict[str, float | None]:
        """Every registry signal of ``role``, reduced over its fresh pods (or the routers)."""
        pods, routers = self.fresh(role, now), self.fresh(ROUTER, now)
        return {s.key: s.reduce(routers if s.router else pods, s.metrics[role])
                for s in registry.for_role(role)}

    def role_signals(self, role: str, now: float, *, ready: int, starting: int,
                     pending: int) -> RoleSignals:
        return registry.assemble(self.raw(role, now), ready=ready, starting=starting,
                                 pending=pending)


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
