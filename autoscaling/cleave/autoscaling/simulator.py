"""Discrete-event simulation of a Cleave deployment under a trace, autoscaled by a policy.

Workers (:mod:`cleave.autoscaling.simworker`) each hold the whole model; a worker's current
role (prefill, decode, or both) decides what the router sends it. The router follows Cleave's
rules (``runtime/cleave/runtime/serving/routing.py``): a request goes to the least-loaded
prefill worker, then its KV to the decode worker with the most free KV; with the convertible
rules on, a prompt whose prefill would finish after the router's TTFT target behind that
worker's backlog is served whole by a decode worker (chunked prefill inside its decode steps),
and with no decode worker up a prefill worker serves whole requests. Replicas claim their GPUs
when scheduled, serve after a cold start, are slow for their first steps, and drain before they
go; a flip stops a worker's intake for ``flip_s``. Every ``interval_s`` the autoscaler decides
from what was scraped ``scrape_lag_s`` earlier into the operator's own
:class:`~cleave.autoscaling.signals.SignalCollector`, through the one autoscaler loop
(:mod:`cleave.autoscaling.loop`) with this simulation as its backend; an elastic autoscaler
then plans flips with :func:`cleave.autoscaling.flips.plan_flips`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import replace

from cleave.autoscaling.baselines import ROLES, Autoscaler, AutoscalerDecider, Planner
from cleave.autoscaling.flips import FlipPlan, WorkerView
from cleave.autoscaling.llmd import EPP_TPOT_BUCKETS, EPP_TTFT_BUCKETS
from cleave.autoscaling.loop import AutoscalerLoop, Observed, Tick, run_now
from cleave.autoscaling.policy import DECODE, PREFILL
from cleave.autoscaling.report import Change
from cleave.autoscaling.signals import TPOT, TTFT, WAITING, Histogram, PodMetrics, SignalCollector
from cleave.autoscaling.simreplicas import INF, RUNNING, Lifetime, SimRequest, _Hist
from cleave.autoscaling.simresult import Sample, SimConfig, SimResult, p90
from cleave.autoscaling.simworker import BOTH, Worker
from cleave.autoscaling.traces import Trace

__all__ = ["Sample", "SimConfig", "SimResult", "Simulation", "simulate"]

_ARRIVAL, _STEP, _HANDOFF, _READY, _SCRAPE, _TICK = range(6)


class Simulation:
    def __init__(self, trace: Trace, config: SimConfig, autoscaler: Autoscaler,
                 progress: Callable[[float, float], None] | None = None) -> None:
        if config.engine.decode_budget is None:
            config = replace(config, engine=replace(config.engine,
                                                    decode_budget=config.decode_budget()))
        self.trace, self.cfg, self.autoscaler, self.progress = trace, config, autoscaler, progress
        self.collector = SignalCollector(window_s=config.metrics_window_s,
                                         stale_after_s=2 * config.interval_s)
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.workers: list[Worker] = []
        self.pending: dict[str, int] = {PREFILL: 0, DECODE: 0}
        self.held: list[SimRequest] = []  # router-held: no worker to take the prompt
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
        # The gateway's per-request histograms (llm-d's EPP exports these; its law reads them).
        self.gateway = {TTFT: _Hist(EPP_TTFT_BUCKETS), TPOT: _Hist(EPP_TPOT_BUCKETS)}
        self._gateway_marks = [0, 0]
        self._gateway_seen: dict[str, Histogram] = {}
        # The one autoscaler loop, this simulation its backend: every tick re-applies what
        # was decided (a scale also places replicas that waited for GPUs).
        self.loop = AutoscalerLoop(self, AutoscalerDecider(autoscaler), act_every_tick=True)

    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, obj))

    # --- workers --------------------------------------------------------------------------

    def _live(self) -> list[Worker]:
        return [w for w in self.workers if not w.life.draining]

    def _gpus_in_use(self) -> int:
        return sum(self.cfg.gpus(w.home) for w in self.workers if w.life.gone == INF)

    def _add(self, home: str, now: float, ready_at: float) -> None:
        self._names += 1
        role = BOTH if self.cfg.aggregated else None
        w = Worker(f"{home}-{self._names}", home, Lifetime(now, ready_at), self.cfg.cost,
                   self.cfg.engine, role)
        self.workers.append(w)
        self._push(ready_at, _READY, w)  # releases what the router held meanwhile

    def _retire(self, w: Worker, now: float) -> None:
        w.life.draining = True
        if w.idle():
            w.life.gone = min(now, w.life.gone)

    def _start(self, home: str, n: int, now: float) -> None:
        self.pending[home] += n
        budget = self.cfg.cluster_gpus
        while self.pending[home] and (budget is None or
                                      self._gpus_in_use() + self.cfg.gpus(home) <= budget):
            self.pending[home] -= 1
            self._add(home, now, now + self.cfg.cold_start_s)

    def _scale(self, home: str, want: int, now: float) -> None:
        live = [w for w in self._live() if w.home == home]
        excess = len(live) + self.pending[home] - want
        if excess < 0:
            self._start(home, -excess, now)
            return
        drop = min(excess, self.pending[home])
        self.pending[home] -= drop
        # Kubernetes removes not-ready pods first, then the least busy.
        for w in sorted(live, key=lambda w: (w.life.ready_at <= now, w.load, w.name))[
                :excess - drop]:
            self._retire(w, now)

    def _apply(self, plan: FlipPlan, now: float) -> None:
        by_name = {w.name: w for w in self._live()}
        for name, role in plan.flips:
            by_name[name].flip(role, now, self.cfg.flip_s)
            self._push(now + self.cfg.flip_s, _READY, by_name[name])
            self.result.flips += 1
        for name in plan.remove:
            self._retire(by_name[name], now)
        for home, n in plan.start.items():
            self.pending[home] = 0  # the plan counts every pod it wants
            self._start(home, n, now)

    # --- the request path (the router) ----------------------------------------------------

    def _serving(self, role: str, now: float) -> list[Worker]:
        return [w for w in self.workers if w.serves(role, now)]

    def _go(self, w: Worker, req: SimRequest, now: float, handoff: bool, path: str) -> None:
        if not req.routed:  # a request re-dispatched was counted on its first path
            self.result.paths[path] = self.result.paths.get(path, 0) + 1
            req.routed = True
        end = w.submit(req, now, handoff)
        if end is not None:
            self._push(end, _STEP, w)

    def _route(self, req: SimRequest, now: float) -> None:
        pre, dec = self._serving(PREFILL, now), self._serving(DECODE, now)
        if not pre and not dec:
            self.held.append(req)
            return
        if not pre:
            self._go(_best_decode(dec), req, now, False, "decode_only")
            return
        p = min(pre, key=lambda w: (w.load, w.name))
        if p.role == BOTH:
            self._go(p, req, now, False, "both")
        elif not dec:
            self._go(p, req, now, False, "prefill_only")
        elif self.cfg.convertible and self._late(p, req):
            self._go(_best_decode(dec), req, now, False, "prefill_backlog")
        else:
            self._go(p, req, now, True, "disaggregated")

    def _late(self, p: Worker, req: SimRequest) -> bool:
        """The router's backlog rule (routing.choose_path): prompts are queued on the chosen
        prefill worker, and they and this prompt, at the worker's speed, finish after the
        TTFT target."""
        per_token = self.cfg.cost.prefill_seconds(req.n_in) / req.n_in
        return p.queued_tokens > 0 and \
            (p.queued_tokens + req.n_in) * per_token > self.cfg.router_ttft_target

    def _to_decode(self, req: SimRequest, now: float) -> None:
        dec = self._serving(DECODE, now)
        if not dec:
            self.held_decode.append(req)
            return
        w = _best_decode(dec)
        end = w.admit(req, now)
        if end is not None:
            self._push(end, _STEP, w)

    def _redispatch(self, now: float) -> None:
        """A worker became ready (new, or flipped into its role): the prompts queued on the
        others that have not started and can still meet the router's TTFT target are routed
        again as if they arrived now, oldest first. Older ones stay: moved ahead of new arrivals
        they only turn those into misses too (re-dispatching every queued prompt lowered the
        step trace's attainment)."""
        deadline = now - self.cfg.router_ttft_target
        moved = sorted((r for w in self._live() for r in w.withdraw(deadline)),
                       key=lambda r: r.arrival)
        self.result.redispatched += len(moved)
        for req in moved:
            self._route(req, now)

    def _release_held(self, now: float) -> None:
        held, held_d = self.held, self.held_decode
        self.held, self.held_decode = [], []
        for req in held:
            self._route(req, now)
        for req in held_d:
            self._to_decode(req, now)

    def _handle(self, now: float, kind: int, obj: object) -> None:
        if kind == _ARRIVAL:
            assert isinstance(obj, SimRequest)
            self._route(obj, now)
        elif kind == _STEP:
            assert isinstance(obj, Worker)
            done, handed, end = obj.step_done(now)
            self._dones += done
            for req in handed:
                self._firsts.append(req)
                self._push(req.t_first, _HANDOFF, req)
            self._firsts += obj.firsts
            obj.firsts = []
            if end is not None:
                self._push(end, _STEP, obj)
            elif obj.life.draining and obj.idle():
                obj.life.gone = now
        elif kind == _HANDOFF:
            assert isinstance(obj, SimRequest)
            if obj.n_out <= 1:  # the prefill's token was the whole answer
                obj.t_done = now
                self._dones.append(obj)
            else:
                self._to_decode(obj, now)
        elif kind == _READY:
            self._release_held(now)
            if self.cfg.redispatch:
                self._redispatch(now)
        elif kind == _SCRAPE:
            self._scrape(now)
        else:
            self._tick(now)

    # --- the autoscaler -------------------------------------------------------------------

    def _scrape_gateway(self) -> None:
        firsts, dones = self._gateway_marks
        for r in self._firsts[firsts:]:
            self.gateway[TTFT].observe(r.ttft)
        for r in self._dones[dones:]:
            if r.n_out > 1:  # the EPP records a TPOT only for a request with one to average
                self.gateway[TPOT].observe(r.tpot)
        self._gateway_marks = [len(self._firsts), len(self._dones)]
        self._gateway_seen = {k: h.snapshot() for k, h in self.gateway.items()}

    def _scrape(self, now: float) -> None:
        self._scrape_gateway()
        live_names = ["router"]
        for w in self.workers:
            if w.life.gone != INF or w.life.ready_at > now:
                continue
            # Prefill work is counted wherever it runs: a both-worker's and a decode worker's
            # prefills of whole requests (path prefill_backlog) are prefill demand and TTFT,
            # so the policy sizes prefill on every prompt, not only those prefill workers took.
            # Decode is what decode and both-workers hold. (The real collector must do the
            # same with the workers' path-labelled series.)
            views = [PREFILL] if w.role in (PREFILL, BOTH) or w.prompt_tokens else []
            views += [DECODE] if w.role in (DECODE, BOTH) else []
            for role in views:
                name = f"{w.name}/{role}"
                self.collector.record(name, role, now, w.metrics(role))
                live_names.append(name)
        held = float(len(self.held) + len(self.held_decode))
        self.collector.record("router", "router", now,
                              PodMetrics({}, {WAITING: held, RUNNING: 0.0}, frozenset({"router"})))
        self.collector.forget(live_names)

    def _counts(self, role: str, now: float) -> tuple[int, int]:
        ready = starting = 0
        for w in self._live():
            if w.life.ready_at > now:
                starting += w.home == role or w.role == BOTH
            elif w.role in (role, BOTH):
                if w.role_at <= now:
                    ready += 1
                else:
                    starting += 1  # flipping into the role: capacity on its way
        return ready, starting

    def _tick(self, now: float) -> None:
        run_now(self.loop.tick(now))

    # --- the loop's backend (cleave.autoscaling.loop): no I/O, so no event loop either --------

    async def observe(self, now: float) -> Observed:
        signals, in_flight = {}, {}
        for role in ROLES:
            ready, starting = self._counts(role, now)
            signals[role] = self.collector.role_signals(
                role, now, ready=ready, starting=starting, pending=self.pending[role])
            in_flight[role] = float(sum(w.load for w in self._live() if w.role in (role, BOTH)))
        in_flight[PREFILL] += len(self.held)
        in_flight[DECODE] += len(self.held_decode)
        current = {r: s.ready + s.starting + s.pending for r, s in signals.items()}
        workers = None
        if isinstance(self.autoscaler, Planner) and not self.cfg.aggregated:
            workers = tuple(WorkerView(w.name, w.home, w.role, w.life.ready_at <= now,
                                       float(w.load)) for w in self._live())
        return Observed(signals, current, current, workers, in_flight, self._gateway_seen)

    async def scale(self, change: Change, now: float) -> bool:
        self._scale(change.role, change.desired, now)
        return True

    async def carry_out(self, plan: FlipPlan, now: float) -> bool:
        self._apply(plan, now)
        return True

    async def tell(self, tick: Tick) -> None:
        now, desired = tick.now, {d.role: d.desired for d in tick.decisions}
        self.result.reasons += [(now, d.role, d.desired, d.reason) for d in tick.decisions
                                if d.desired != d.current]
        plan = tick.plan
        if plan is not None and (plan.flips or plan.remove or any(plan.start.values())):
            self.result.reasons.append((now, "plan", sum(desired.values()), plan.reason))
        self._sample(now, tuple(desired.get(r, 0) for r in ROLES))
        if self.progress is not None:
            self.progress(now, self.trace.duration)

    def _sample(self, now: float, desired: tuple[int, ...]) -> None:
        arrivals, firsts, dones = self._marks
        counts = [self._counts(role, now) for role in ROLES]
        self.result.samples.append(Sample(
            now, (self._arrived - arrivals) / self.cfg.interval_s,
            (counts[0][0], counts[1][0]), (counts[0][1], counts[1][1]), self._gpus_in_use(),
            p90([r.ttft for r in self._firsts[firsts:]]),
            p90([r.tpot for r in self._dones[dones:]]), (desired[0], desired[1])))
        self._marks = [self._arrived, len(self._firsts), len(self._dones)]

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> SimResult:
        cfg = self.cfg
        for role, n in zip(ROLES, cfg.initial, strict=True):
            for _ in range(n):
                self._add(role, 0.0, 0.0)
                self.workers[-1].life.ready_at = -cfg.engine.warmup_s  # warm: running before
        self._push(cfg.interval_s, _TICK, None)
        self._push(max(0.0, cfg.interval_s - cfg.scrape_lag_s), _SCRAPE, None)
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
            if kind in (_TICK, _SCRAPE):
                self._push(now + cfg.interval_s, kind, None)
            self._handle(now, kind, obj)
        self._account()
        return self.result

    def _account(self) -> None:
        """Replica-seconds inside the trace per home role: a worker holds its GPUs from being
        scheduled (cold start included) through flips until it has drained."""
        horizon = self.trace.duration
        for role in ROLES:
            self.result.replica_seconds[role] = sum(
                max(0.0, min(w.life.gone, horizon) - max(0.0, min(w.life.born, horizon)))
                for w in self.workers if w.home == role)


def _best_decode(workers: list[Worker]) -> Worker:
    return min(workers, key=lambda w: (round(w.kv_usage, 1), w.load, w.name))


def simulate(trace: Trace, config: SimConfig, autoscaler: Autoscaler,
             progress: Callable[[float, float], None] | None = None) -> SimResult:
    return Simulation(trace, config, autoscaler, progress).run()
