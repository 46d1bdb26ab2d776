"""Discrete-event simulation of a role-split deployment under a trace, autoscaled by a policy.

A request is routed at arrival to the least-loaded ready prefill replica (FIFO, one prompt at a
time: prefill is compute-bound, batching prompts would not raise its throughput), gets its first
token once its KV is saved to the store, is loaded by the decode replica with the most free KV
(then the least load) and decoded with continuous batching. Replicas claim their GPUs when
scheduled and serve after a cold start; removed ones drain their work first, as a terminating pod
does. Every ``interval_s`` every ready pod is scraped into the same
:class:`~cleave.operator.autoscaler.signals.SignalCollector` the operator uses, and the
autoscaler sees only those signals: windowed p90s of what finished, gauges, counters.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from cleave.operator.autoscaler.baselines import ROLES, Autoscaler, Observation
from cleave.operator.autoscaler.policy import DECODE, PREFILL
from cleave.operator.autoscaler.signals import WAITING, PodMetrics, SignalCollector
from cleave.operator.autoscaler.simreplicas import (
    INF,
    RUNNING,
    DecodeReplica,
    Lifetime,
    PrefillReplica,
    Replica,
    SimRequest,
)
from cleave.operator.autoscaler.simresult import Sample, SimConfig, SimResult, p90
from cleave.operator.autoscaler.traces import Trace

__all__ = ["Sample", "SimConfig", "SimResult", "Simulation", "simulate"]

_ARRIVAL, _PREFILL_DONE, _HANDOFF, _STEP_DONE, _READY, _TICK = range(6)


class Simulation:
    def __init__(self, trace: Trace, config: SimConfig, autoscaler: Autoscaler,
                 progress: Callable[[float, float], None] | None = None) -> None:
        self.trace, self.cfg, self.autoscaler, self.progress = trace, config, autoscaler, progress
        self.collector = SignalCollector(window_s=config.metrics_window_s,
                                         stale_after_s=2 * config.interval_s)
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.replicas: dict[str, list[Replica]] = {PREFILL: [], DECODE: []}
        self.pending: dict[str, int] = {PREFILL: 0, DECODE: 0}
        self.held_prefill: list[SimRequest] = []  # router-held: no ready replica of the role
        self.held_decode: list[SimRequest] = []
        self.requests = [SimRequest(r.arrival, r.prompt_tokens, r.output_tokens)
                         for r in trace.requests]
        self.result = SimResult(autoscaler.name, trace.name, trace.duration, config,
                                self.requests, {PREFILL: 0.0, DECODE: 0.0})
        self._names = 0
        self._arrived = 0
        self._marks = [0, 0, 0]  # arrivals, first tokens, completions at the last tick
        self._firsts: list[SimRequest] = []
        self._dones: list[SimRequest] = []

    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, obj))

    # --- replicas -------------------------------------------------------------------------

    def _live(self, role: str) -> list[Replica]:
        return [r for r in self.replicas[role] if not r.life.draining]

    def _ready(self, role: str, now: float) -> list[Replica]:
        return [r for r in self._live(role) if r.life.ready_at <= now]

    def _gpus_in_use(self) -> int:
        return sum(self.cfg.gpus(role) for role in ROLES for r in self.replicas[role]
                   if r.life.gone == INF)

    def _add(self, role: str, now: float, ready_at: float) -> None:
        self._names += 1
        life = Lifetime(now, ready_at)
        name = f"{role}-{self._names}"
        rep: Replica = (PrefillReplica(name, life, self.cfg.cost) if role == PREFILL
                        else DecodeReplica(name, life, self.cfg.cost))
        self.replicas[role].append(rep)
        # Even one ready at once (no cold start) must release what the router held meanwhile.
        self._push(ready_at, _READY, rep)

    def _retire(self, rep: Replica, now: float) -> None:
        rep.life.draining = True
        if rep.load == 0:
            rep.life.gone = min(now, rep.life.gone)

    def _scale(self, role: str, want: int, now: float) -> None:
        live = self._live(role)
        while len(live) + self.pending[role] < want:
            self.pending[role] += 1
        excess = len(live) + self.pending[role] - want
        drop = min(excess, self.pending[role])
        self.pending[role] -= drop
        excess -= drop
        # Kubernetes removes not-ready pods first, then the least busy.
        for rep in sorted(live, key=lambda r: (r.life.ready_at <= now, r.load, r.name))[:excess]:
            self._retire(rep, now)
        budget = self.cfg.cluster_gpus
        while self.pending[role] and (budget is None or
                                      self._gpus_in_use() + self.cfg.gpus(role) <= budget):
            self.pending[role] -= 1
            self._add(role, now, now + self.cfg.cold_start_s)

    # --- the request path -----------------------------------------------------------------

    def _to_prefill(self, req: SimRequest, now: float) -> None:
        ready = self._ready(PREFILL, now)
        if not ready:
            self.held_prefill.append(req)
            return
        rep = min(ready, key=lambda r: (r.load, r.name))
        assert isinstance(rep, PrefillReplica)
        end = rep.enqueue(req, now)
        if end is not None:
            self._push(end, _PREFILL_DONE, rep)

    def _to_decode(self, req: SimRequest, now: float) -> None:
        ready = self._ready(DECODE, now)
        if not ready:
            self.held_decode.append(req)
            return
        rep = min(ready, key=lambda r: (round(r.kv_usage, 1) if isinstance(r, DecodeReplica)
                                        else 0.0, r.load, r.name))
        assert isinstance(rep, DecodeReplica)
        end = rep.enqueue(req, now)
        if end is not None:
            self._push(end, _STEP_DONE, rep)

    def _release_held(self, now: float) -> None:
        held_p, held_d = self.held_prefill, self.held_decode
        self.held_prefill, self.held_decode = [], []
        for req in held_p:
            self._to_prefill(req, now)
        for req in held_d:
            self._to_decode(req, now)

    def _handle(self, now: float, kind: int, obj: object) -> None:
        if kind == _ARRIVAL:
            assert isinstance(obj, SimRequest)
            self._to_prefill(obj, now)
        elif kind == _PREFILL_DONE:
            assert isinstance(obj, PrefillReplica)
            req, end = obj.finish(now)
            if end is not None:
                self._push(end, _PREFILL_DONE, obj)
            elif obj.life.draining:
                obj.life.gone = now
            self._firsts.append(req)
            load = self.cfg.cost.kv_transfer_seconds(req.n_in)
            self._push(req.t_first + load, _HANDOFF, req)
        elif kind == _HANDOFF:
            assert isinstance(obj, SimRequest)
            if obj.n_out <= 1:  # the prefill's token was the whole answer
                obj.t_done = now
                self._dones.append(obj)
            else:
                self._to_decode(obj, now)
        elif kind == _STEP_DONE:
            assert isinstance(obj, DecodeReplica)
            done, end = obj.step_done(now)
            self._dones += done
            if end is not None:
                self._push(end, _STEP_DONE, obj)
            elif obj.life.draining:
                obj.life.gone = now
        elif kind == _READY:
            self._release_held(now)
        else:
            self._tick(now)

    # --- the autoscaler -------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        live_names = ["router"]
        in_flight = {PREFILL: float(len(self.held_prefill)), DECODE: float(len(self.held_decode))}
        for role in ROLES:
            for rep in self._ready(role, now):
                self.collector.record(rep.name, role, now, rep.metrics())
                live_names.append(rep.name)
                in_flight[role] += rep.load
        held = float(len(self.held_prefill) + len(self.held_decode))
        self.collector.record("router", "router", now,
                              PodMetrics({}, {WAITING: held, RUNNING: 0.0}, frozenset({"router"})))
        self.collector.forget(live_names)
        signals = {}
        for role in ROLES:
            live = self._live(role)
            ready = sum(r.life.ready_at <= now for r in live)
            signals[role] = self.collector.role_signals(
                role, now, ready=ready, starting=len(live) - ready, pending=self.pending[role])
        decisions = self.autoscaler.decide(now, Observation(signals, in_flight))
        for role in ROLES:
            want, why = decisions[role]
            if want != len(self._live(role)) + self.pending[role]:
                self.result.reasons.append((now, role, want, why))
            self._scale(role, want, now)
        self._sample(now, tuple(decisions[r][0] for r in ROLES))
        if self.progress is not None:
            self.progress(now, self.trace.duration)

    def _sample(self, now: float, desired: tuple[int, ...]) -> None:
        def p90_since(items: list[SimRequest], mark: int, value: Callable[[SimRequest], float]
                      ) -> float | None:
            return p90([value(r) for r in items[mark:]])

        arrivals, firsts, dones = self._marks
        counts = [[0, 0], [0, 0]]
        for i, role in enumerate(ROLES):
            for r in self._live(role):
                counts[r.life.ready_at > now][i] += 1
        self.result.samples.append(Sample(
            now, (self._arrived - arrivals) / self.cfg.interval_s,
            (counts[0][0], counts[0][1]), (counts[1][0], counts[1][1]), self._gpus_in_use(),
            p90_since(self._firsts, firsts, lambda r: r.ttft),
            p90_since(self._dones, dones, lambda r: r.tpot), (desired[0], desired[1])))
        self._marks = [self._arrived, len(self._firsts), len(self._dones)]

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.cfg
        for role, n in zip(ROLES, cfg.initial, strict=True):
            for _ in range(n):
                self._add(role, 0.0, 0.0)
        self._push(cfg.interval_s, _TICK, None)
        end = self.trace.duration + cfg.drain_limit_s
        reqs, i = self.requests, 0
        while True:
            t_next = self.events[0][0] if self.events else INF
            if i < len(reqs) and reqs[i].arrival <= t_next:
                self._arrived += 1
                self._handle(reqs[i].arrival, _ARRIVAL, reqs[i])
                i += 1
                continue
            if t_next > end or (i == len(reqs) and len(self._dones) == len(reqs)
                                and t_next > self.trace.duration):
                break
            now, _, kind, obj = heapq.heappop(self.events)
            if kind == _TICK:
                self._push(now + cfg.interval_s, _TICK, None)
            self._handle(now, kind, obj)
        self._account()
        return self.result

    def _account(self) -> None:
        """Replica-seconds inside the trace: a replica holds its GPUs from being scheduled
        (cold start included) until it has drained."""
        horizon = self.trace.duration
        for role in ROLES:
            self.result.replica_seconds[role] = sum(
                max(0.0, min(r.life.gone, horizon) - min(r.life.born, horizon))
                for r in self.replicas[role])


def simulate(trace: Trace, config: SimConfig, autoscaler: Autoscaler,
             progress: Callable[[float, float], None] | None = None) -> SimResult:
    return Simulation(trace, config, autoscaler, progress).run()
