"""A Prometheus server as the autoscaler's signal source, instead of scraping every pod.

The same figures as :class:`~cleave.autoscaling.signals.SignalCollector`, asked of
Prometheus: p90 latency from ``histogram_quantile`` over ``rate()`` of the buckets, token rates,
mean KV usage and the queues (the role's workers plus the router's held requests). Series are
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

from cleave.autoscaling.policy import DECODE, PREFILL, RoleSignals
from cleave.autoscaling.signals import (
    GENERATION_TOKENS,
    KV_USAGE,
    PROMPT_TOKENS,
    TPOT,
    TTFT,
    WAITING,
)

_ROLE_MATCH = {PREFILL: "prefill", DECODE: "decode|both"}  # "both" workers serve decode


class PrometheusError(RuntimeError):
    """The server did not answer a query with a vector."""


# What a server that is down, slow or odd can cause: the signals are then missing.
_FAILURES = (TimeoutError, aiohttp.ClientError, PrometheusError, ValueError, KeyError,
             IndexError, TypeError)


def queries(namespace: str, service: str, role: str, window_s: float) -> dict[str, str]:
    """The PromQL of each signal of ``role`` (pure, so the exact text is tested)."""
    sel = f'namespace="{namespace}", llmservice="{service}"'
    worker = f'{{{sel}, role=~"{_ROLE_MATCH[role]}"}}'
    window = f"[{max(1, round(window_s))}s]"
    latency = TTFT if role == PREFILL else TPOT
    tokens = PROMPT_TOKENS if role == PREFILL else GENERATION_TOKENS
    out = {
        "latency_p90": f"histogram_quantile(0.9, sum by (le) "
                       f"(rate({latency}_bucket{worker}{window})))",
        "token_rate": f"sum(rate({tokens}_total{worker}{window}))",
        "queue_role": f"sum({WAITING}{worker})",
        "queue_router": f'sum({WAITING}{{{sel}, role="router"}})',
    }
    if role == DECODE:
        out["kv_usage"] = f"avg({KV_USAGE}{worker})"
    return out


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
                 timeout_s: float) -> float | None:
    async with session.get(f"{url.rstrip('/')}/api/v1/query", params={"query": promql},
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise PrometheusError(f"HTTP {resp.status}")
        return scalar(await resp.json(content_type=None))


async def role_signals(session: aiohttp.ClientSession, url: str, namespace: str, service: str,
                       role: str, window_s: float, *, ready: int, starting: int, pending: int,
                       timeout_s: float = 5.0) -> RoleSignals | None:
    """One role's signals from Prometheus at ``url``; None if the server failed."""
    asked = queries(namespace, service, role, window_s)
    # Every query runs to its end (each is bounded): a plain gather would leave the others
    # running unowned after the first failure.
    answers = await asyncio.gather(*(_query(session, url, q, timeout_s)
                                     for q in asked.values()), return_exceptions=True)
    values: dict[str, float | None] = {}
    for key, answer in zip(asked, answers, strict=True):
        if isinstance(answer, _FAILURES):
            return None
        if isinstance(answer, BaseException):
            raise answer
        values[key] = answer
    own, held = values["queue_role"], values["queue_router"]
    if own is not None:
        queue: float | None = own + (held or 0.0)
    elif ready + starting == 0:
        queue = held  # at zero only the router sees demand
    else:
        queue = None  # replicas exist but report nothing: unknown, not empty
    token_rate = values["token_rate"]
    if token_rate is None and ready + starting == 0 and held is not None:
        token_rate = 0.0  # nothing exists to produce tokens
    return RoleSignals(latency_p90=values["latency_p90"], kv_usage=values.get("kv_usage"),
                       queue_depth=queue, token_rate=token_rate, ready=ready,
                       starting=starting, pending=pending)
