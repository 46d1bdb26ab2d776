"""A Prometheus server as the autoscaler's signal source, instead of scraping every pod.

The same figures as :class:`~cleave.autoscaling.signals.SignalCollector`, asked of
Prometheus: every signal of the registry (:mod:`cleave.autoscaling.registry`) by its PromQL,
combined by the registry's ``assemble`` exactly as the pod scraper's figures are. Series are
selected by the labels the chart's ServiceMonitor gives them: ``namespace`` and ``llmservice``
(from the Services' ``app.kubernetes.io/instance``). Replica counts still come from Kubernetes.
Any failure gives None, which the caller turns into missing metrics: the policy holds.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import aiohttp

from cleave.autoscaling import registry
from cleave.autoscaling.policy import RoleSignals

# The chart's ServiceMonitor scrape interval (charts/cleave/values.yaml): the throughput
# signal reads pairs of consecutive samples.
SCRAPE_SECONDS = 15.0


class PrometheusError(RuntimeError):
    """The server did not answer a query with a vector."""


# What a server that is down, slow or odd can cause: the signals are then missing.
_FAILURES = (TimeoutError, aiohttp.ClientError, PrometheusError, ValueError, KeyError,
             IndexError, TypeError)


def queries(namespace: str, service: str, role: str, window_s: float,
            scrape_s: float = SCRAPE_SECONDS) -> dict[str, str]:
    """The PromQL of each registry signal of ``role`` (pure, so the exact text is tested)."""
    sel = f'namespace="{namespace}", llmservice="{service}"'
    q = registry.Query(workers=f'{{{sel}, role=~"{registry.ROLE_MATCH[role]}"}}',
                       router=f'{{{sel}, role="router"}}', window=f"{max(1, round(window_s))}s",
                       scrape_s=scrape_s)
    return {s.key: s.promql(q, s.metrics[role]) for s in registry.for_role(role)}


def scalar(answer: Mapping[str, Any]) -> float | None:
    """The one value of an instant-vector answer; None for an empty vector (no such series:
    nothing scraped recently) or NaN (no observations in the window)."""
    if answer.get("status") != "success":
        raise PrometheusError(str(answer.get("error") or answer))
    data = answer.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusError(f"expected a vector, got {data.get('resultType')!r}")
    result = data.get("result") or []
    if not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


async def _query(session: aiohttp.ClientSession, url: str, promql: str,
                 timeout_s: float, at: float | None) -> float | None:
    params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
    async with session.get(f"{url.rstrip('/')}/api/v1/query", params=params,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise PrometheusError(f"HTTP {resp.status}")
        return scalar(await resp.json(content_type=None))


async def role_signals(session: aiohttp.ClientSession, url: str, namespace: str, service: str,
                       role: str, window_s: float, *, ready: int, starting: int, pending: int,
                       timeout_s: float = 5.0,
                       scrape_s: float = SCRAPE_SECONDS,
                       at: float | None = None) -> RoleSignals | None:
    """One role's signals from Prometheus at ``url`` (now, or at the Unix time ``at``); None
    if the server failed."""
    asked = queries(namespace, service, role, window_s, scrape_s)
    # Every query runs to its end (each is bounded): a plain gather would leave the others
    # running unowned after the first failure.
    answers = await asyncio.gather(*(_query(session, url, q, timeout_s, at)
                                     for q in asked.values()), return_exceptions=True)
    values: dict[str, float | None] = {}
    for key, answer in zip(asked, answers, strict=True):
        if isinstance(answer, _FAILURES):
            return None
        if isinstance(answer, BaseException):
            raise answer
        values[key] = answer
    return registry.assemble(values, ready=ready, starting=starting, pending=pending)
