"""What the load really is, from what a scraper sees: the policy's demand side (pure).

Served token rates stop rising once replicas saturate, so demand is read from the queue too:
arrivals = served + queue growth. Requests are dispatched on arrival, so a replica holding a
backlog stays busy with it however many replicas join. And a new replica takes ``startup_s`` to
serve, so capacity must already cover the rise in demand that can happen in that time: the
policy learns how large such rises have been recently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cleave.autoscaling.limits import EPS

# A queue outgrowing service by this share, and holding over this many requests per ready
# replica, is a load step rather than the noise of a busy queue.
STEP_GROWTH = 0.2
STEP_QUEUE_PER_REPLICA = 2.0
MIN_RISE_SAMPLES = 8  # fewer demand samples than this teach nothing about rises


def queue_growth(queue_depth: float | None, now: float,
                 last: tuple[float, float, int] | None) -> float | None:
    """Requests/s the queue grew by since the last decision; ``last`` is (time, depth, ready)."""
    if last is None or queue_depth is None or now <= last[0]:
        return None
    return (queue_depth - last[1]) / (now - last[0])


def token_demand(token_rate: float | None, request_rate: float | None,
                 growth: float | None) -> float | None:
    """Tokens/s arriving: served plus the queue's growth (negative while a backlog drains),
    converted at the served tokens per request. Without a request rate: what was served."""
    if token_rate is None or growth is None or not request_rate:
        return token_rate
    return max(0.0, token_rate * (1.0 + growth / request_rate))


def held_by_backlog(queue_depth: float | None, request_rate: float | None,
                    growth: float | None, ready: int, last_ready: int) -> int:
    """Ready replicas tied up by a backlog: those that were already ready while the queue
    outgrew what they serve. Replicas that just became ready hold none of it."""
    if (growth is None or not request_rate or queue_depth is None
            or growth <= STEP_GROWTH * request_rate
            or queue_depth <= STEP_QUEUE_PER_REPLICA * max(1, ready)):
        return 0
    return min(ready, last_ready)


def demand_rise(history: Sequence[tuple[float, float]], horizon_s: float, quantile: float,
                lookback_s: float) -> float:
    """The ``quantile`` of how much demand rose over ``horizon_s`` (each sample over the last
    one at least that much older; a point-to-point ratio, since the minimum of a window of
    noisy samples would read noise as rises) across ``history`` of (time, demand): the headroom
    a replica count needs so that rises of that size are served while new replicas start.
    Time not yet observed counts as no rise, so one early step does not set the headroom for
    the rest of the ``lookback_s``: a rise must be frequent over that time to be covered."""
    rises = []
    j = -1
    for t, d in history:
        while j + 1 < len(history) and t - history[j + 1][0] >= horizon_s:
            j += 1
        if j >= 0 and history[j][1] > 0:
            rises.append(max(1.0, d / history[j][1]))
    if len(rises) < MIN_RISE_SAMPLES:
        return 1.0
    spacing = (history[-1][0] - history[0][0]) / (len(history) - 1)
    rises += [1.0] * max(0, int(lookback_s / spacing) - len(rises)) if spacing > 0 else []
    rises.sort()
    return rises[min(len(rises) - 1, math.ceil(quantile * len(rises)) - 1)]


def latency_hold(prefill: bool, ready: int, starting: int, queue_depth: float | None,
                 growth: float | None, last_ready: int) -> str | None:
    """Why a latency breach should not add a replica now, or None. With a capacity model at
    hand the latency error says *whether* to add one, the model says how many: queueing latency
    is far from proportional to load and keeps growing while new replicas start, so asking
    ready * ratio every interval overshoots several-fold."""
    if starting > 0:
        return "replicas starting: the capacity model alone may ask for more"
    if ready > last_ready:
        return "replicas just became ready: wait an interval to see their effect"
    if growth is not None and growth < 0:
        return "queue draining: the breach is the backlog, not the load"
    if prefill and queue_depth is not None and queue_depth < STEP_QUEUE_PER_REPLICA * ready:
        return "under two waiting requests per replica: TTFT is the prompts' compute"
    return None


def projected_kv_replicas(arrival_rate: float, prompt_tokens: float, output_tokens: float,
                          tpot_s: float, kv_bytes_per_token: float, kv_bytes_per_replica: float,
                          watermark: float) -> int:
    """Decode replicas the KV the arriving load will hold needs, before the cache fills.

    Streams arrive at ``arrival_rate`` and each grows KV at one token per step for
    ``output_tokens`` steps: arrivals x output length x KV bytes per token is the rate the
    cache fills at. Over a stream's life (``output_tokens * tpot_s``) that settles, by Little's
    law, at arrival_rate * output_tokens * tpot_s streams holding (prompt + output / 2) tokens
    each on average; sized at ``watermark`` of each replica's KV room."""
    streams = arrival_rate * output_tokens * tpot_s
    held = streams * (prompt_tokens + output_tokens / 2) * kv_bytes_per_token
    return max(0, math.ceil(held / (kv_bytes_per_replica * watermark) - EPS))


@dataclass(frozen=True)
class Observed:
    growth: float | None
    demand: float | None
    rise: float
    history: tuple[tuple[float, float], ...]
    learning: bool

    def notes(self) -> dict[str, str]:
        out = {k: f"{v:.4g}" for k, v in (("queue_growth", self.growth),
                                          ("demand", self.demand)) if v is not None}
        if self.learning:
            out["rise"] = f"{self.rise:.4g}"
        return out


def observe(now: float, token_rate: float | None, request_rate: float | None,
            queue_depth: float | None, last: tuple[float, float, int] | None,
            history: Sequence[tuple[float, float]], startup_s: float, quantile: float,
            lookback_s: float) -> Observed:
    """This interval's demand, and the history of demand the rise headroom is learned from
    (kept only when ``startup_s`` > 0)."""
    growth = queue_growth(queue_depth, now, last)
    demand = token_demand(token_rate, request_rate, growth)
    seen = tuple((t, d) for t, d in history if now - t <= lookback_s)
    if startup_s <= 0 or demand is None:
        return Observed(growth, demand, 1.0, seen, startup_s > 0)
    seen += ((now, demand),)
    return Observed(growth, demand, demand_rise(seen, startup_s, quantile, lookback_s), seen,
                    True)
