"""Per-role SLO autoscaling policy: pure functions from scraped signals to desired replicas.

No I/O and no clock: the caller passes ``now`` and the signals, and keeps the returned
:class:`ScalingState` for the next call. Every :class:`Decision` carries its inputs and a reason so
the operator can publish it in the LLMService status and a human can see why it scaled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from cleave.autoscaling.convertible import ConvertiblePrefill, prefill_replicas
from cleave.autoscaling.demand import (
    held_by_backlog,
    latency_hold,
    observe,
    projected_kv_replicas,
)
from cleave.autoscaling.floor import floor_fits, floor_hold
from cleave.autoscaling.limits import EPS, fit_limits
from cleave.autoscaling.roles import DECODE, PREFILL

__all__ = ["DECODE", "PREFILL", "Decision", "FloorPolicy", "KvProjection", "PolicyConfig",
           "RolePolicy", "RoleSignals", "ScalingState", "decide", "seed"]
_LATENCY_NAME = {PREFILL: "ttft", DECODE: "tpot"}
_HUGE = 1e6  # any count past every max: keeps ceil() finite when a throughput is near zero


def _ceil(x: float) -> int:
    return math.ceil(min(x, _HUGE) - EPS)


@dataclass(frozen=True)
class RoleSignals:
    """What the collector saw for one role. A metric of None is missing or stale, never zero."""

    latency_p90: float | None = None  # TTFT for prefill, TPOT for decode, seconds
    kv_usage: float | None = None  # decode: fraction of KV blocks in use
    queue_depth: float | None = None  # waiting requests; the router's count when at zero
    token_rate: float | None = None  # demand: prompt tok/s (prefill), output tok/s (decode)
    throughput_per_replica: float | None = None  # measured saturated tok/s of one replica
    ready: int = 0
    starting: int = 0  # scheduled, not ready: capacity already on its way
    pending: int = 0  # unschedulable: asked for, but no capacity at all
    request_rate: float | None = None  # requests served/s (prefill: the TTFT histogram's count)


@dataclass(frozen=True)
class KvProjection:
    """Decode sizing on the KV the arriving load will hold, not only the KV in use now: the
    mean request's prompt and output tokens, and the model's and a replica's KV bytes."""

    prompt_tokens: float
    output_tokens: float
    kv_bytes_per_token: float
    kv_bytes_per_replica: float
    watermark: float = 0.8


@dataclass(frozen=True)
class RolePolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    latency_target: float | None = None
    kv_watermark: float | None = None
    gpus_per_replica: int = 0
    hysteresis: float = 0.1  # relative band around each target where nothing moves
    up_window_s: float = 0.0  # up fast: latency SLOs are breached now
    down_window_s: float = 300.0  # down slow: a replica removed too early costs a cold start
    max_step_up: int = 4
    max_step_down: int = 1
    target_utilization: float = 0.8  # capacity model headroom below saturation
    prior_throughput: float | None = None  # DESIGN.md arithmetic, used until one is measured
    startup_s: float = 0.0  # a new replica's time to ready; > 0 keeps room for load rises
    rise_quantile: float = 0.95  # of the rises in demand within startup_s ...
    rise_lookback_s: float = 3600.0  # ... seen over this long
    kv_projection: KvProjection | None = None  # decode: grow before the cache fills


@dataclass(frozen=True)
class FloorPolicy:
    """The one-worker floor: taken once the load has fitted ``utilization`` of one worker (the
    prefill and decode shares of a replica's capacity added) for ``hold_s`` straight, left at
    the first interval it does not. Leaving costs a cold start for the second worker, so the
    floor is kept for load well below one worker."""

    utilization: float = 0.3
    hold_s: float = 300.0


@dataclass(frozen=True)
class PolicyConfig:
    roles: Mapping[str, RolePolicy]
    gpu_budget: int | None = None
    ratio_bounds: tuple[float, float] | None = None  # allowed prefill/decode replica ratio
    scale_to_zero: bool = False
    mode: str = "Cleave"
    floor: FloorPolicy | None = None  # None: never one worker for both roles
    convertible: ConvertiblePrefill | None = None  # decode workers' prefill, as prefill headroom

    def __post_init__(self) -> None:
        # Checked once here so decide() can trust its config and never has to pick a rule to break.
        for name, p in self.roles.items():
            if not 0 <= p.min_replicas <= p.max_replicas:
                raise ValueError(f"{name}: need 0 <= min_replicas <= max_replicas")
            if p.max_step_up < 1 or p.max_step_down < 1:
                raise ValueError(f"{name}: max steps must be >= 1")
        floor = sum(p.min_replicas * p.gpus_per_replica for p in self.roles.values())
        if self.gpu_budget is not None and floor > self.gpu_budget:
            raise ValueError(f"minReplicas need {floor} GPUs, over the budget {self.gpu_budget}")
        if self.ratio_bounds is not None and not 0 < self.ratio_bounds[0] <= self.ratio_bounds[1]:
            raise ValueError("ratio_bounds must satisfy 0 < low <= high")


@dataclass(frozen=True)
class ScalingState:
    """Recent raw recommendations per role, (time, replicas), for the stabilization windows."""

    history: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    # Per role at the last decision: (time, queue depth, ready replicas), for the queue's growth.
    queues: Mapping[str, tuple[float, float, int]] = field(default_factory=dict)
    demand: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # The floor: since when the load has fitted one worker, and whether to serve it with one
    # worker in both roles now (the backends pass it to flips.plan_flips).
    floor_since: float | None = None
    colocate: bool = False


# Old enough to fall outside a zero up-window (a seed must not block the first scale-up),
# young enough to sit inside any scale-down delay.
_SEED_AGE_S = 1e-3


def seed(now: float, replicas: Mapping[str, int]) -> ScalingState:
    """A fresh history that remembers recommending the current replicas, for a loop that
    starts (or restarts) with replicas already up: none is removed before a whole scale-down
    window of new recommendations agrees, as if the loop had been running all along."""
    return ScalingState({r: ((now - _SEED_AGE_S, n),) for r, n in replicas.items()})


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str
    inputs: Mapping[str, str]


def _ratio_need(ready: int, ratio: float, capacity: int, band: float) -> int:
    """Replicas that bring observed/target to 1 if load spreads evenly over ready replicas.
    Over target never asks for fewer than the capacity (ready + starting: the starting ones get
    credit), under target never for more; inside the band nothing moves, so noise cannot flap."""
    if ratio > 1.0 + band:
        return max(capacity, _ceil(ready * ratio))
    if ratio < 1.0 - band:
        return min(capacity, _ceil(ready * ratio))
    return capacity


def _need(role: str, s: RoleSignals, p: RolePolicy, notes: dict[str, str],
          last: tuple[float, float, int] | None, growth: float | None, demand: float | None,
          rise: float, lent: float = 0.0) -> tuple[int | None, str]:
    """Raw replicas the signals ask for (before windows and limits); None means hold."""
    capacity = s.ready + s.starting
    last_ready = last[2] if last else s.ready
    if s.queue_depth == 0 and s.token_rate == 0:
        return 0, "idle: no queue and no tokens"  # an idle role has no latency samples either
    tput = s.throughput_per_replica or p.prior_throughput
    if s.throughput_per_replica and p.prior_throughput:
        # A rate measured while a queue existed proves a replica can do at least that much,
        # not that it cannot do more: a short queue at one scrape is no saturation.
        tput = max(s.throughput_per_replica, p.prior_throughput)
    cap_need: int | None = None
    sized: float | None = None
    if demand is not None and tput:
        # Headroom: the target utilization, or room for the recent rises in demand within a
        # startup time (the capacity decode workers lend covers those first), whichever is larger.
        sized = prefill_replicas(demand, p.target_utilization, demand * rise, tput, lent)
        cap_need = _ceil(sized)
        held = held_by_backlog(s.queue_depth, s.request_rate, growth, s.ready,
                               last[2] if last else 0)
        if held:  # the whole demand has to be met by the other replicas
            cap_need += held
            notes["backlog"] = f"{held} ready replicas held by a growing queue"
    if capacity == 0:
        # At zero no replica reports latency: only demand seen upstream can wake the role.
        if (s.queue_depth or 0) > 0 or (s.token_rate or 0) > 0:
            return max(1, cap_need or 0), "demand while at zero"
        return None, "at zero and demand unknown"
    name = _LATENCY_NAME.get(role, "latency")
    needs: dict[str, int] = {}
    if p.latency_target is not None:
        if s.latency_p90 is None:
            return None, f"{name} missing or stale"
        if s.ready == 0:
            return None, "no ready replica to measure"
        ratio = s.latency_p90 / p.latency_target
        needs[name] = _ratio_need(s.ready, ratio, capacity, p.hysteresis)
        # A configured capacity model sizes the role; latency then only says whether to move.
        # Without one (a measured rate alone is too rough to size by), latency sizes it.
        modelled = cap_need is not None and p.prior_throughput is not None
        if modelled and needs[name] > capacity:
            why = latency_hold(role == PREFILL, s.ready, s.starting, s.queue_depth, growth,
                               last_ready)
            needs[name] = capacity if why else min(needs[name], capacity + 1)
            if why:
                notes[f"{name}_held"] = why
        elif modelled and ratio < 1.0 - p.hysteresis:
            # Under target it has no objection; how far down is the capacity model's call
            # (at low load TTFT is the prompts' own compute, not a measure of spare replicas).
            del needs[name]
            notes[f"{name}_held"] = "under target: sizing left to the capacity model"
    if p.kv_watermark is not None:
        if s.kv_usage is None:
            return None, "kv usage missing or stale"
        needs["kv"] = _ratio_need(s.ready, s.kv_usage / p.kv_watermark, capacity, p.hysteresis)
    if cap_need is not None and "backlog" in notes:
        needs["capacity"] = max(capacity, cap_need)
    elif sized is not None:
        needs["capacity"] = _ratio_need(capacity, sized / capacity, capacity, p.hysteresis)
    if not needs:
        return None, "no target and no capacity signal"
    notes.update({f"need_{k}": str(v) for k, v in needs.items()})
    # Scale to the most demanding signal: down only when every signal agrees.
    top = max(needs, key=lambda k: needs[k])
    return needs[top], f"{top} asks for {needs[top]}"


def _projected_kv(p: RolePolicy, signals: Mapping[str, RoleSignals],
                  notes: dict[str, str]) -> int | None:
    """Replicas the projected KV asks for: arrivals (the requests prefill served per second, the
    whole load once it reaches decode) for a stream's life at the measured p90 TPOT (the target
    until one is measured: a stream lives longer as decode slows, so this errs high)."""
    proj = p.kv_projection
    rate = signals[PREFILL].request_rate if PREFILL in signals else None
    tpot = signals[DECODE].latency_p90 if DECODE in signals else None
    tpot = tpot if tpot is not None else p.latency_target
    if proj is None or rate is None or tpot is None:
        return None
    n = projected_kv_replicas(rate, proj.prompt_tokens, proj.output_tokens, tpot,
                              proj.kv_bytes_per_token, proj.kv_bytes_per_replica, proj.watermark)
    notes["need_projected_kv"] = str(n)
    return n


def _lent(role: str, signals: Mapping[str, RoleSignals], cfg: PolicyConfig, rise: float,
          notes: dict[str, str]) -> float:
    """Prefill: the prompt tok/s the ready decode workers can prefill beside their batches once
    the load has risen by ``rise`` (their batches grow with it)."""
    if role != PREFILL or cfg.convertible is None or DECODE not in signals:
        return 0.0
    out = signals[DECODE].token_rate
    lent = cfg.convertible.lent(signals[DECODE].ready, None if out is None else out * rise)
    notes["lent_by_decode"] = f"{lent:.4g}"
    return lent


def _stabilize(now: float, need: int, s: RoleSignals, p: RolePolicy,
               hist: list[tuple[float, int]]) -> tuple[int, str]:
    capacity, current = s.ready + s.starting, s.ready + s.starting + s.pending
    if need > current:
        # Up only as far as the whole up window agrees, and at most max_step_up at once.
        ups = [r for t, r in hist if now - t <= p.up_window_s]
        stab = max(current, min(ups))
        desired = min(stab, current + p.max_step_up)
        return desired, f"up to {desired} (window {stab}, step {p.max_step_up})"
    if need >= capacity:
        # Only drops pending pods: they serve nothing, so no window is needed, and a scale-up
        # that cannot be scheduled never blocks a scale-down.
        return need, "hold" if need == current else f"drop {current - need} pending"
    downs = [r for t, r in hist if now - t <= p.down_window_s]
    stab = min(capacity, max(downs))
    desired = max(stab, capacity - p.max_step_down)
    return desired, f"down to {desired} (window {stab}, step {p.max_step_down})"


def _clean(s: RoleSignals) -> RoleSignals:
    """A NaN, infinite or negative metric is a broken scrape: treat it as missing, not as data."""
    def ok(v: float | None) -> float | None:
        return v if v is not None and math.isfinite(v) and v >= 0 else None
    return replace(s, latency_p90=ok(s.latency_p90), kv_usage=ok(s.kv_usage),
                   queue_depth=ok(s.queue_depth), token_rate=ok(s.token_rate),
                   throughput_per_replica=ok(s.throughput_per_replica),
                   request_rate=ok(s.request_rate))


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"


def _inputs(s: RoleSignals, p: RolePolicy) -> dict[str, str]:
    return {"latency_p90": _fmt(s.latency_p90), "latency_target": _fmt(p.latency_target),
            "kv_usage": _fmt(s.kv_usage), "kv_watermark": _fmt(p.kv_watermark),
            "queue_depth": _fmt(s.queue_depth), "token_rate": _fmt(s.token_rate),
            "throughput_per_replica": _fmt(s.throughput_per_replica),
            "request_rate": _fmt(s.request_rate), "ready": str(s.ready),
            "starting": str(s.starting), "pending": str(s.pending),
            "min": str(p.min_replicas), "max": str(p.max_replicas)}


def decide(now: float, signals: Mapping[str, RoleSignals], cfg: PolicyConfig,
           state: ScalingState) -> tuple[tuple[Decision, ...], ScalingState]:
    """One autoscaling interval. ``signals`` must hold every role in ``cfg.roles``: replica counts
    come from Kubernetes and are always known, only the metrics may be None."""
    roles = sorted(cfg.roles)
    signals = {r: _clean(signals[r]) for r in roles}
    current = {r: signals[r].ready + signals[r].starting + signals[r].pending for r in roles}
    notes = {r: _inputs(signals[r], cfg.roles[r]) for r in roles}
    if cfg.mode != "Cleave":  # never fight an external autoscaler or a user over replicas
        off = f"autoscaling mode {cfg.mode}: replicas left alone"
        return tuple(Decision(r, current[r], current[r], off, notes[r]) for r in roles), state
    horizon = max((max(p.up_window_s, p.down_window_s) for p in cfg.roles.values()), default=0.0)
    want: dict[str, int] = {}
    why: dict[str, list[str]] = {}
    history: dict[str, tuple[tuple[float, int], ...]] = {}
    queues: dict[str, tuple[float, float, int]] = {}
    demand: dict[str, tuple[tuple[float, float], ...]] = {}
    for r in roles:
        s, p = signals[r], cfg.roles[r]
        kept = [(t, n) for t, n in state.history.get(r, ()) if now - t <= horizon]
        if s.queue_depth is not None:
            queues[r] = (now, s.queue_depth, s.ready)
        last = state.queues.get(r)
        seen = observe(now, s.token_rate, s.request_rate, s.queue_depth, last,
                       state.demand.get(r, ()), p.startup_s, p.rise_quantile, p.rise_lookback_s)
        demand[r] = seen.history
        notes[r].update(seen.notes())
        lent = _lent(r, signals, cfg, seen.rise, notes[r])
        need, because = _need(r, s, p, notes[r], last, seen.growth, seen.demand, seen.rise, lent)
        kv_need = _projected_kv(p, signals, notes[r])
        if kv_need is not None and need is not None and kv_need > need:
            need, because = kv_need, f"projected kv asks for {kv_need}"
        if need is None:
            want[r], why[r] = current[r], [f"hold: {because}"]
        else:
            kept.append((now, need))
            want[r], step = _stabilize(now, need, s, p, kept)
            why[r] = [because, step]
        history[r] = tuple(kept)
    want = fit_limits(want, why, cfg)
    colocate, since = _floor(now, want, signals, cfg, state.floor_since)
    decisions = tuple(Decision(r, current[r], want[r], "; ".join(why[r]), notes[r])
                      for r in roles)
    return decisions, ScalingState(history, queues, demand, since, colocate)


def _floor(now: float, want: Mapping[str, int], signals: Mapping[str, RoleSignals],
           cfg: PolicyConfig, since: float | None) -> tuple[bool, float | None]:
    """(one worker for both roles now, since when the load has fitted one): on each role's
    demand against its capacity per replica (the prior, else a measured rate)."""
    if cfg.floor is None or set(cfg.roles) != {PREFILL, DECODE}:
        return False, None
    tput = {r: cfg.roles[r].prior_throughput or signals[r].throughput_per_replica
            for r in (PREFILL, DECODE)}
    fits = floor_fits(want, signals[PREFILL].token_rate, tput[PREFILL],
                      signals[DECODE].token_rate, tput[DECODE], cfg.floor.utilization)
    return floor_hold(now, fits, since, cfg.floor.hold_s)
