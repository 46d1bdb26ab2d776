"""``cleave up --autoscale``: the local backend of the one autoscaler loop
(:mod:`cleave.autoscaling.loop`), driving worker processes with the operator's policy.

Every interval: scrape each ready worker's and the router's ``/metrics``, turn them into
per-role signals (the same ``SignalCollector`` and signal registry the operator uses); the loop
asks the same pure ``policy.decide`` for desired replicas; this backend starts or drains worker
processes and logs each decision that changed anything with its reason and inputs. A worker
is removed in order: out of the router's list first (the workers file), then, once the router
holds no request on it, SIGTERM, on which the worker finishes what it has and exits. With
``--advisory`` nothing is changed: the decisions are only logged.

Elastic roles (docs/autoscaling.md): with both roles and flips on, the per-role decisions are
met by ``flips.plan_flips`` first: a warm worker the other role can spare is flipped
(``POST /internal/role``, a second, no restart); only what flips cannot cover starts new
workers. A worker is counted, scraped and planned in its current role; a restarted one is
back in its home role.

Each decision is told as the operator tells it, less the Kubernetes Event: the log line, the
operator's metrics (``cleave_autoscaler_desired_replicas`` and ``_decisions_total``, with
``llmservice="cleave-up"``, ``namespace="local"``) and the ``status.autoscaler`` block, here a
JSON file rewritten whenever it changes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from cleave.autoscaling import metrics, report
from cleave.autoscaling.flips import BOTH, FlipPlan, WorkerView
from cleave.autoscaling.loop import AutoscalerLoop, Observed, PolicyDecider, Tick
from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.policy import Decision, ScalingState
from cleave.autoscaling.signals import SignalCollector, Target, collect
from cleave.runtime.serving.autoscale_settings import AutoscaleSettings
from cleave.runtime.serving.internal_auth import bearer
from cleave.runtime.serving.local_processes import READY, STARTING, LocalProcess, Supervisor
from cleave.runtime.serving.membership import write_atomically

SERVICE, NAMESPACE = "cleave-up", "local"  # the metrics' llmservice and namespace labels
WORKER_GRACE_SECONDS = 30.0  # `cleave worker --grace-period` default


class LocalAutoscaler:
    def __init__(self, settings: AutoscaleSettings, supervisor: Supervisor, router_url: str,
                 api_key: str | None, drain_timeout_s: float,
                 status_path: Path | None = None, internal_token: str | None = None) -> None:
        self.settings = settings
        self.status_path = status_path
        self.sup = supervisor
        self.router_url = router_url
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A flip is an /internal/* call: it carries the workers' token, not the API key.
        self._internal = bearer(internal_token) if internal_token else {}
        self.drain_timeout_s = drain_timeout_s
        # Stale after a few missed scrapes, never sooner than a slow scrape could answer.
        self.collector = SignalCollector(settings.metrics_window_s,
                                         stale_after_s=max(10.0, 3 * settings.interval_s))
        self.decider = PolicyDecider(settings.policy)
        self.loop = AutoscalerLoop(self, self.decider, advisory=settings.advisory)
        # Set by each tick for the backend's steps: the session, and the workers observed.
        self._session: aiohttp.ClientSession | None = None
        self._ready: dict[str, list[LocalProcess]] = {}
        self._starting: dict[str, list[LocalProcess]] = {}
        self._drains: set[asyncio.Task[None]] = set()
        # Flipped workers: name -> (the process it was flipped in, its current role). Keyed
        # by pid too, so a restarted process is back in its home role.
        self._flipped: dict[str, tuple[int, str]] = {}

    @property
    def state(self) -> ScalingState | None:
        """The policy's state (None before the first tick)."""
        return self.decider.state

    def role_now(self, p: LocalProcess) -> str:
        """A worker's current role: its home role unless this process was flipped."""
        pid, role = self._flipped.get(p.name, (-1, p.role))
        return role if pid == p.proc.pid else p.role

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self._run(stop)),
                                  name="autoscaler", daemon=True)
        thread.start()
        return thread

    async def _run(self, stop: threading.Event) -> None:
        async with aiohttp.ClientSession() as session:
            try:
                while not stop.is_set():
                    try:
                        await self.tick(session)
                    except Exception:  # one bad interval must not end autoscaling for good
                        self.sup.say(f"autoscale interval failed:\n{traceback.format_exc()}")
                    deadline = time.monotonic() + self.settings.interval_s
                    while not stop.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
            finally:
                # Drains still waiting on the router end here, while their session is open;
                # stopping cleave up SIGTERMs (and reaps) every worker anyway.
                for task in list(self._drains):
                    task.cancel()
                await asyncio.gather(*self._drains, return_exceptions=True)

    async def tick(self, session: aiohttp.ClientSession) -> tuple[Decision, ...]:
        """One interval of the loop; the decisions made."""
        self._session = session
        tick = await self.loop.tick(time.monotonic())
        return () if tick is None else tick.decisions

    # --- the loop's backend -----------------------------------------------------------------

    async def observe(self, now: float) -> Observed:
        roles = self.settings.worker_roles
        live = self.sup.workers(sorted(set(roles.values())), READY)
        # A worker serving both roles (the floor) is ready in each.
        ready = {r: [p for p in live if self.role_now(p) in (w, BOTH)] for r, w in roles.items()}
        starting = {r: self.sup.workers([w], STARTING) for r, w in roles.items()}
        self._ready, self._starting = ready, starting
        # The router's held requests are the demand of a role at zero: scrape it too.
        routers = [p for p in self.sup.all() if p.role == "router"]
        assert self._session is not None
        signals = await collect(
            self.collector, self._session,
            [Target(p.name, self.role_now(p), p.url + "/metrics") for p in [*live, *routers]],
            {r: PodCounts(ready=len(ready[r]), starting=len(starting[r])) for r in roles},
            now, timeout_s=min(2.0, self.settings.interval_s))
        up = {r: len(ready[r]) + len(starting[r]) for r in roles}
        views = None
        if self.settings.flips:  # each worker in its current role, for the flip planner
            views = tuple({p.name: WorkerView(p.name, p.role, self.role_now(p), True)
                           for procs in ready.values() for p in procs}.values())
            views += tuple(WorkerView(p.name, p.role, p.role, False)
                           for procs in starting.values() for p in procs)
        return Observed(signals, up, up, views)

    async def scale(self, change: report.Change, now: float) -> bool:
        assert self._session is not None
        return self._apply(self._session, change.decision, self._ready[change.role],
                           self._starting[change.role])

    async def carry_out(self, plan: FlipPlan, now: float) -> bool:
        """Flips first, then new workers, then drains of what is left over (the operator's
        plan, on local processes); False if a flip failed (the next tick plans again)."""
        assert self._session is not None
        self.sup.say(f"autoscaler plan: {plan.reason}")
        procs = {p.name: p for p in self.sup.all()}
        ok = True
        for name, role in plan.flips:
            ok = await self._flip(self._session, procs[name], role) and ok
        for role, n in plan.start.items():
            for _ in range(n):
                try:
                    p = self.sup.spawn_worker(self.settings.worker_roles[role])
                except RuntimeError:
                    return False  # stopping
                self.sup.say(f"starting {p.name} on {p.url}")
        for name in plan.remove:
            self._start_drain(self._session, procs[name])
        return ok

    async def tell(self, tick: Tick) -> None:
        """As the operator tells it, less the Event: log lines, metrics, the status file."""
        roles, advisory = self.settings.worker_roles, self.settings.advisory
        for d in tick.decisions:
            metrics.set_desired(SERVICE, NAMESPACE, roles[d.role], d.desired, advisory)
        for change in tick.done:
            self.sup.say(report.log_line("", change, role=roles[change.role]))
            metrics.count_decision(SERVICE, NAMESPACE, roles[change.role], change.direction,
                                   advisory)
        if tick.status is not None:
            self._write_status(tick.status)

    def _write_status(self, block: Mapping[str, Any]) -> None:
        """The status block as a file: written aside and renamed, so a reader never sees half."""
        if self.status_path is not None:
            write_atomically(self.status_path, json.dumps(block, indent=2) + "\n")

    async def _flip(self, session: aiohttp.ClientSession, p: LocalProcess, role: str) -> bool:
        try:
            async with session.post(p.url + "/internal/role", json={"role": role},
                                    headers=self._internal,
                                    timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                ok = r.status == 200
                detail = "" if ok else (await r.text())[:200]
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, detail = False, type(e).__name__
        if ok:
            self._flipped[p.name] = (p.proc.pid, role)
            self.sup.say(f"flipped {p.name} ({p.role} worker) to the {role} role")
        else:
            self.sup.say(f"could not flip {p.name} to {role}: {detail}")
        return ok

    def _start_drain(self, session: aiohttp.ClientSession, p: LocalProcess) -> None:
        task = asyncio.create_task(self._drain(session, p))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def _apply(self, session: aiohttp.ClientSession, d: Decision,
               ready: Sequence[LocalProcess], starting: Sequence[LocalProcess]) -> bool:
        """Start or drain workers of one role; False when stopping (nothing more starts)."""
        if d.desired > d.current:
            for _ in range(d.desired - d.current):
                try:
                    p = self.sup.spawn_worker(self.settings.worker_roles[d.role])
                except RuntimeError:
                    return False  # stopping
                self.sup.say(f"starting {p.name} on {p.url}")
            return True
        # Cheapest first: a worker still starting holds no request; then the newest ones.
        for p in [*reversed(starting), *reversed(ready)][:d.current - d.desired]:
            self._start_drain(session, p)
        return True

    async def _drain(self, session: aiohttp.ClientSession, p: LocalProcess) -> None:
        was = self.sup.begin_drain(p)
        self.sup.say(f"draining {p.name}: out of the router's list, then it finishes its "
                     "requests and exits")
        if was == READY:
            await self._until_router_lets_go(session, p.url)
        self.sup.terminate(p)
        deadline = time.monotonic() + WORKER_GRACE_SECONDS + 10
        while p.proc.poll() is None:
            if time.monotonic() > deadline:
                p.proc.kill()
            await asyncio.sleep(0.1)
        self.sup.forget(p)
        self.sup.say(f"{p.name} stopped (exit code {p.proc.returncode})")

    async def _until_router_lets_go(self, session: aiohttp.ClientSession, url: str) -> None:
        """The router re-reads the workers file every second and keeps a removed worker only
        while requests it sent there are still open; wait until it lists it no more."""
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            listed = await self._router_workers(session)
            if listed is not None and url not in listed:
                return
            await asyncio.sleep(0.25)
        self.sup.say(f"the router still uses {url} after {self.drain_timeout_s:g} s; "
                     "stopping it anyway")

    async def _router_workers(self, session: aiohttp.ClientSession) -> set[str] | None:
        """The URLs the router tracks; None when it cannot say (then nothing is assumed)."""
        try:
            async with session.get(self.router_url + "/internal/workers", headers=self._auth,
                                   timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                if r.status != 200:
                    return None
                body: dict[str, Any] = await r.json()
                return {str(w["url"]) for role in ("prefill", "decode")
                        for w in body.get(role, [])}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None
