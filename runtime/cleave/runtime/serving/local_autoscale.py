"""``cleave up --autoscale``: the operator's scaling policy, driving local worker processes.

Every interval: scrape each ready worker's and the router's ``/metrics``, turn them into
per-role signals (the same ``SignalCollector`` the operator uses), ask the same pure
``policy.decide`` for desired replicas, log each decision that changes anything with its reason
and inputs, and start or drain worker processes. A worker is removed in order: out of the
router's list first (the workers file), then, once the router holds no request on it, SIGTERM,
on which the worker finishes what it has and exits. With ``--advisory`` nothing is changed:
the decisions are only logged.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from cleave.operator.autoscaler import report
from cleave.operator.autoscaler.policy import (
    DECODE,
    PREFILL,
    Decision,
    PolicyConfig,
    RolePolicy,
    ScalingState,
    decide,
)
from cleave.operator.autoscaler.signals import SignalCollector, Target, collect
from cleave.operator.status import PodCounts
from cleave.runtime.serving.local_processes import READY, STARTING, LocalProcess, Supervisor

DEFAULT_HOLD_SECONDS = 60.0  # a local cold start takes seconds; leave room on a busy machine
WORKER_GRACE_SECONDS = 30.0  # `cleave worker --grace-period` default
_DEFAULTS = {"ttft_slo": 1.0, "tpot_slo": 0.1, "kv_watermark": 0.8, "autoscale_interval": 5.0,
             "scale_up_window": 0.0, "scale_down_window": 60.0, "metrics_window": 30.0}
_ONLY_WITH_AUTOSCALE = ("prefill_min", "prefill_max", "decode_min", "decode_max", *_DEFAULTS,
                        "scale_to_zero", "advisory")


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "autoscaling", "With --autoscale, worker processes are started and stopped by the same "
        "policy the Kubernetes operator runs; --prefill and --decode are the starting counts.")
    g.add_argument("--autoscale", action="store_true",
                   help="scale each role between its min and max on its SLO signal")
    g.add_argument("--advisory", action="store_true",
                   help="dry run: log every decision, start and stop nothing")
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-min", type=int, default=None, metavar="N",
                       help=f"fewest {role} workers (default 1; 0 with --scale-to-zero)")
        g.add_argument(f"--{role}-max", type=int, default=None, metavar="N",
                       help=f"most {role} workers (default 2" +
                            ("; 0 when --prefill 0: colocated)" if role == "prefill" else ")"))
    g.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="prefill target: p90 time to first token (default 1.0; 0: none)")
    g.add_argument("--tpot-slo", type=float, default=None, metavar="SECONDS",
                   help="decode target: p90 time per output token (default 0.1; 0: none)")
    g.add_argument("--kv-watermark", type=float, default=None, metavar="RATIO",
                   help="decode target: mean KV cache usage (default 0.8; 0: none)")
    g.add_argument("--scale-to-zero", action="store_true",
                   help="idle roles may stop every worker (minimums default to 0); the router "
                        "holds requests meanwhile and its queue wakes them")
    g.add_argument("--autoscale-interval", type=float, default=None, metavar="SECONDS",
                   help="seconds between decisions (default 5)")
    g.add_argument("--scale-up-window", type=float, default=None, metavar="SECONDS",
                   help="scale up only as far as every decision in this window agrees "
                        "(default 0: at once)")
    g.add_argument("--scale-down-window", type=float, default=None, metavar="SECONDS",
                   help="scale down only as far as every decision in this window agrees "
                        "(default 60)")
    g.add_argument("--metrics-window", type=float, default=None, metavar="SECONDS",
                   help="p90 latencies and token rates over this many seconds (default 30)")


@dataclass(frozen=True)
class AutoscaleSettings:
    policy: PolicyConfig
    worker_roles: Mapping[str, str]  # policy role -> the worker role its processes run
    initial: Mapping[str, int]  # policy role -> workers to start with
    interval_s: float
    metrics_window_s: float
    advisory: bool
    hold_timeout_s: float


def _clamp(n: int, low: int, high: int) -> int:
    return min(max(n, low), high)


def settings_from_args(args: argparse.Namespace) -> AutoscaleSettings | None:
    """The autoscaling settings (None without --autoscale); ValueError naming the bad flag."""
    if not args.autoscale:
        given = [k for k in _ONLY_WITH_AUTOSCALE if getattr(args, k) not in (None, False)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --autoscale")
        return None
    v = {k: _DEFAULTS[k] if getattr(args, k) is None else float(getattr(args, k))
         for k in _DEFAULTS}
    if v["autoscale_interval"] <= 0 or v["metrics_window"] <= 0:
        raise ValueError("--autoscale-interval and --metrics-window must be > 0")
    for k in ("ttft_slo", "tpot_slo", "kv_watermark", "scale_up_window", "scale_down_window"):
        if v[k] < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 0")
    if v["kv_watermark"] > 1:
        raise ValueError("--kv-watermark is a ratio of the KV pool: at most 1")
    low = 0 if args.scale_to_zero else 1
    bounds: dict[str, tuple[int, int]] = {}
    for role, start in ((PREFILL, args.prefill), (DECODE, args.decode)):
        default_max = 0 if role == PREFILL and start == 0 else 2
        high = default_max if getattr(args, f"{role}_max") is None else getattr(args, f"{role}_max")
        given_min = getattr(args, f"{role}_min")
        least = min(low, high) if given_min is None else given_min
        if not 0 <= least <= high:
            raise ValueError(f"need 0 <= --{role}-min ({least}) <= --{role}-max ({high})")
        bounds[role] = (least, high)
    if bounds[DECODE][1] < 1:
        raise ValueError("--decode-max must be at least 1: decode workers serve every request")
    up, down = v["scale_up_window"], v["scale_down_window"]
    roles = {DECODE: RolePolicy(*bounds[DECODE], latency_target=v["tpot_slo"] or None,
                                kv_watermark=v["kv_watermark"] or None, up_window_s=up,
                                down_window_s=down)}
    if bounds[PREFILL][1] > 0:
        roles[PREFILL] = RolePolicy(*bounds[PREFILL], latency_target=v["ttft_slo"] or None,
                                    up_window_s=up, down_window_s=down)
    hold = DEFAULT_HOLD_SECONDS if args.hold_timeout is None else args.hold_timeout
    if hold < 0:
        raise ValueError("--hold-timeout must be >= 0")
    return AutoscaleSettings(
        policy=PolicyConfig(roles, scale_to_zero=args.scale_to_zero),
        worker_roles={PREFILL: PREFILL, DECODE: DECODE} if PREFILL in roles else {DECODE: "both"},
        initial={PREFILL: _clamp(args.prefill, *bounds[PREFILL]),
                 DECODE: _clamp(args.decode, *bounds[DECODE])},
        interval_s=v["autoscale_interval"], metrics_window_s=v["metrics_window"],
        advisory=args.advisory, hold_timeout_s=hold)


def describe_settings(s: AutoscaleSettings) -> str:
    parts = []
    for role, p in sorted(s.policy.roles.items()):
        targets = [f"{'ttft' if role == PREFILL else 'tpot'} p90 <= {p.latency_target:g} s"
                   if p.latency_target else "", f"kv <= {p.kv_watermark:g}" if p.kv_watermark
                   else ""]
        parts.append(f"{s.worker_roles[role]} {p.min_replicas}..{p.max_replicas} "
                     f"({', '.join(t for t in targets if t) or 'capacity only'})")
    mode = "advisory (decisions are logged, nothing changes)" if s.advisory else "acting"
    return (f"autoscaling {'; '.join(parts)} every {s.interval_s:g} s, {mode}; scale to zero "
            f"{'on' if s.policy.scale_to_zero else 'off'}; requests held up to "
            f"{s.hold_timeout_s:g} s while no decode worker is ready")


class LocalAutoscaler:
    def __init__(self, settings: AutoscaleSettings, supervisor: Supervisor, router_url: str,
                 api_key: str | None, drain_timeout_s: float) -> None:
        self.settings = settings
        self.sup = supervisor
        self.router_url = router_url
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.drain_timeout_s = drain_timeout_s
        # Stale after a few missed scrapes, never sooner than a slow scrape could answer.
        self.collector = SignalCollector(settings.metrics_window_s,
                                         stale_after_s=max(10.0, 3 * settings.interval_s))
        self.state = ScalingState()
        # What the operator keeps in status.autoscaler, in memory: which decisions were told.
        self.told: dict[str, Any] | None = None
        self._drains: set[asyncio.Task[None]] = set()

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
        roles = self.settings.worker_roles
        ready = {r: self.sup.workers([w], READY) for r, w in roles.items()}
        starting = {r: self.sup.workers([w], STARTING) for r, w in roles.items()}
        # The router's held requests are the demand of a role at zero: scrape it too.
        scraped = [*(p for r in roles for p in ready[r]),
                   *(p for p in self.sup.all() if p.role == "router")]
        now = time.monotonic()
        signals = await collect(
            self.collector, session, [Target(p.name, p.role, p.url + "/metrics")
                                      for p in scraped],
            {r: PodCounts(ready=len(ready[r]), starting=len(starting[r])) for r in roles},
            now, timeout_s=min(2.0, self.settings.interval_s))
        decisions, self.state = decide(now, signals, self.settings.policy, self.state)
        advisory = self.settings.advisory
        # The operator's rule for what to tell (and act on): a desired count that differs
        # from the current one; in advisory mode, from the last one told, so a standing
        # recommendation is logged once.
        found = report.changes(decisions, {d.role: d.current for d in decisions}, self.told,
                               advisory)
        for change in found:
            self.sup.say(report.log_line("", change, role=roles[change.role]))
            if change.act:
                self._apply(session, change.decision, ready[change.role],
                            starting[change.role])
        if report.needs_write(self.told, found, advisory):
            self.told = report.status_block(
                self.told, found, {d.role: d.desired for d in decisions}, advisory,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return decisions

    def _apply(self, session: aiohttp.ClientSession, d: Decision,
               ready: Sequence[LocalProcess], starting: Sequence[LocalProcess]) -> None:
        if d.desired > d.current:
            for _ in range(d.desired - d.current):
                try:
                    p = self.sup.spawn_worker(self.settings.worker_roles[d.role])
                except RuntimeError:
                    return  # stopping
                self.sup.say(f"starting {p.name} on {p.url}")
            return
        # Cheapest first: a worker still starting holds no request; then the newest ones.
        for p in [*reversed(starting), *reversed(ready)][:d.current - d.desired]:
            task = asyncio.create_task(self._drain(session, p))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

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
