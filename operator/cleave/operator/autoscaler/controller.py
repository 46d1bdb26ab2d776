"""The Kubernetes backend of the one autoscaler loop (:mod:`cleave.autoscaling.loop`).

A tick lists each role's Deployment and pods, scrapes every ready pod's ``/metrics`` (workers
and routers: the router's held requests are the demand signal of a role at zero) or asks
Prometheus, turns that into the policy's signals; the loop runs :func:`policy.decide` and
then this backend scales the Deployments it owns (or flips pods, with elastic roles) and
publishes what changed (``report``: status, Event, log; metrics). All API access goes through
:class:`~cleave.operator.kube.Kube`.

State (the collector's scrape history, the policy's recommendation history, the role each pod
last told) lives in memory only. Losing it on an operator restart is safe: a fresh collector
has no window, so every latency reads as missing and the policy holds until two scrapes exist;
the fresh policy history is seeded with each role's current replicas, so no scale-down happens
before a whole ``scaleDownDelaySeconds`` of new recommendations agrees; and the pods tell their
roles again at the next tick. Scale-ups are never delayed.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import urllib3
from kubernetes.client.exceptions import ApiException

from cleave.autoscaling import metrics, report
from cleave.autoscaling.flips import FlipPlan
from cleave.autoscaling.loop import AutoscalerLoop, Observed, PolicyDecider, Tick
from cleave.autoscaling.pods import PodCounts
from cleave.autoscaling.policy import Decision, PolicyConfig, RoleSignals
from cleave.autoscaling.signals import ROUTER, SignalCollector, Target, collect
from cleave.operator import builders, security
from cleave.operator.autoscaler import flips, prometheus
from cleave.operator.autoscaler.policy_from_spec import config_from_spec
from cleave.operator.kube import Kube
from cleave.operator.spec import LLMServiceSpec, SpecError, parse_spec
from cleave.operator.status import count_pods, live_pods

log = logging.getLogger("cleave.operator.autoscaler")
SCRAPE_TIMEOUT_S = 2.0
PostEvent = Callable[[str, str], None]  # (reason, message) -> a Normal Event on the service


def interval_seconds(spec: LLMServiceSpec) -> float:
    """The spec's interval; ``CLEAVE_AUTOSCALE_SECONDS`` overrides it for every service."""
    override = float(os.environ.get("CLEAVE_AUTOSCALE_SECONDS", "0") or 0)
    return override if override > 0 else spec.autoscaler.interval_seconds


@dataclass(frozen=True)
class RoleView:
    replicas: int | None  # the Deployment's spec.replicas; None: no Deployment (yet)
    pods: tuple[Mapping[str, Any], ...]


def observe(kube: Kube, spec: LLMServiceSpec) -> dict[str, RoleView]:
    """Every role's Deployment replicas and pods, the router's included."""
    views = {}
    for role in (["prefill"] if spec.prefill else []) + ["decode", ROUTER]:
        deployment = kube.get({"apiVersion": "apps/v1", "kind": "Deployment",
                               "metadata": {"name": f"{spec.name}-{role}",
                                            "namespace": spec.namespace}})
        replicas = None if deployment is None else \
            int((deployment.get("spec") or {}).get("replicas", 1))
        views[role] = RoleView(replicas, tuple(kube.pods(spec.namespace,
                                                         builders.labels(spec, role))))
    return views


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """``http://<podIP>:<port named http>/metrics`` of a ready pod; None if it cannot be
    scraped (not ready: it serves no traffic, so its figures would describe nothing)."""
    base = flips.pod_url(pod)
    return None if base is None else base + "/metrics"


@dataclass(frozen=True)
class _Elastic:
    """What carrying out a flip plan needs from the observation it was planned on."""

    pods: Mapping[str, Mapping[str, Any]]  # the live worker pods by name
    auth: Mapping[str, str]  # the header of a call to a worker's /internal/*


class KubeBackend:
    """The one autoscaler loop's (:mod:`cleave.autoscaling.loop`) Kubernetes backend for one
    LLMService: Deployments and pods through :class:`Kube`, signals scraped from the pods or
    asked of Prometheus, and what was done told in ``status.autoscaler``, Events, logs and the
    operator's metrics. :class:`ServiceAutoscaler` sets the spec, session and Event poster
    before each tick."""

    def __init__(self, kube: Kube, scrape_timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.kube = kube
        self.scrape_timeout_s = scrape_timeout_s
        self.collector: SignalCollector | None = None
        self.spec: LLMServiceSpec | None = None
        self.session: aiohttp.ClientSession | None = None
        self.post_event: PostEvent = lambda reason, message: None
        self._replicas: dict[str, int] = {}  # each worker Deployment's, as last observed
        self._elastic: _Elastic | None = None
        # Each live pod's role as its worker last told it (stats, or a flip taken or left
        # unanswered: flips.after_flip), for a tick its stats miss (flips.roles_now). Lost on a
        # restart: pods are then in their home role until they answer, as before a flip.
        self._said: dict[tuple[str, int], str] = {}

    def _spec(self) -> LLMServiceSpec:
        assert self.spec is not None, "set before a tick"
        return self.spec

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "set before a tick"
        return self.session

    def _collector(self, spec: LLMServiceSpec) -> SignalCollector:
        window = spec.autoscaler.window_seconds
        # Two missed intervals make a pod's last answer stale.
        stale = 2 * interval_seconds(spec) + self.scrape_timeout_s
        c = self.collector
        if c is None or c.window_s != window or c.stale_after_s != stale:
            c = self.collector = SignalCollector(window, stale)
        return c

    async def _scraped(self, spec: LLMServiceSpec, session: aiohttp.ClientSession,
                       views: Mapping[str, RoleView], counts: Mapping[str, PodCounts],
                       now: float, roles_now: Mapping[str, str]) -> dict[str, RoleSignals]:
        # A flipped pod's figures count for the role it works in now.
        targets = [Target(name, roles_now.get(name, role), url) for role, v in views.items()
                   for p in live_pods(v.pods) if (url := metrics_url(p)) is not None
                   and (name := str(p["metadata"]["name"]))]
        return await collect(self._collector(spec), session, targets, counts, now,
                             self.scrape_timeout_s)

    async def _from_prometheus(self, spec: LLMServiceSpec, session: aiohttp.ClientSession,
                               counts: Mapping[str, PodCounts]) -> dict[str, RoleSignals]:
        url = spec.autoscaler.prometheus_url
        assert url is not None
        out = {}
        for r, c in counts.items():
            got = await prometheus.role_signals(
                session, url, spec.namespace, spec.name, r, spec.autoscaler.window_seconds,
                ready=c.ready, starting=c.starting, pending=c.pending,
                timeout_s=self.scrape_timeout_s)
            # A failed query is missing data, never zero: the policy holds.
            out[r] = got or RoleSignals(ready=c.ready, starting=c.starting, pending=c.pending)
        return out

    async def observe(self, now: float) -> Observed | None:
        """Deployments, pods (in their current roles) and signals; None when there is nothing
        to decide yet."""
        spec, session = self._spec(), self._session()
        owned = spec.autoscaled_roles()
        if not owned:
            return None
        views = await asyncio.to_thread(observe, self.kube, spec)
        workers = {r: v for r, v in views.items() if r != ROUTER}
        if any(v.replicas is None for v in workers.values()):
            return None  # the reconcile has not created every Deployment yet
        replicas = {r: v.replicas for r, v in workers.items() if v.replicas is not None}
        counts = {r: count_pods(replicas[r], v.pods) for r, v in workers.items()}
        pods = {r: v.pods for r, v in workers.items()}
        elastic = set(owned) == {"prefill", "decode"}  # flips need both roles in our hands
        auth: dict[str, str] = {}
        if elastic:
            auth = flips.auth(await asyncio.to_thread(
                self.kube.secret_value, spec.namespace,
                security.internal_token_secret_name(spec), "token"))
        roles_now: dict[str, str] = {}
        if elastic:
            reported = await flips.reported_roles(session, pods, self.scrape_timeout_s, auth)
            roles_now, self._said = flips.roles_now(pods, reported, self._said)
        counts = flips.by_current_role(counts, pods, roles_now)
        if spec.autoscaler.prometheus_url:
            signals = await self._from_prometheus(spec, session, counts)
        else:
            signals = await self._scraped(spec, session, views, counts, now, roles_now)
        self._replicas = replicas
        if not elastic:
            self._elastic = None
            return Observed(signals, {r: replicas[r] for r in owned}, replicas)
        self._elastic = _Elastic({str(p["metadata"]["name"]): p for ps in pods.values()
                                  for p in live_pods(ps)}, auth)
        # Elastic: a change is measured against the workers per current role.
        return Observed(signals, {r: c.ready + c.starting + c.pending for r, c in counts.items()},
                        replicas, tuple(flips.worker_views(pods, roles_now)))

    async def scale(self, change: report.Change, now: float) -> bool:
        """Scale one role's Deployment; False if that did not happen. One role's failure must
        not cost the other role its scale, nor a scale already made its status, Event and log
        (the next tick would find nothing left to change and never tell it)."""
        spec = self._spec()
        name = f"{spec.name}-{change.role}"
        try:
            if await asyncio.to_thread(self.kube.scale, spec.namespace, name, change.desired):
                return True
            reason = "the Deployment is gone (the next reconcile recreates it)"
        except (ApiException, urllib3.exceptions.HTTPError) as e:
            reason = f"{type(e).__name__}: {str(e).strip()[:200]}"
        log.warning("%s/%s: cannot scale %s to %d: %s", spec.namespace, spec.name, name,
                    change.desired, reason)
        return False

    async def carry_out(self, plan: FlipPlan, now: float) -> bool:
        """Flip the pods the plan names, then set each home Deployment's replicas (a
        scale-down lets the ReplicaSet pick: not-ready pods first). False if any step failed
        (the next tick plans again from what is); a flip left unanswered is not a failure: the
        pod counts in the role asked until its stats tell (flips.after_flip)."""
        spec, session = self._spec(), self._session()
        assert self._elastic is not None
        where = f"{spec.namespace}/{spec.name}"
        ok = True
        for name, role in plan.flips:
            pod = self._elastic.pods[name]
            answer = await flips.flip(session, pod, role, self.scrape_timeout_s,
                                      self._elastic.auth)
            self._said = flips.after_flip(self._said, flips.container_run(pod), role,
                                          answer.outcome)
            if answer.outcome is flips.Outcome.TAKEN:
                self.post_event("Flipped",
                                f"pod {name} now serves the {role} role ({plan.reason})")
                log.info("%s: flipped pod %s to the %s role", where, name, role)
            elif answer.outcome is flips.Outcome.UNKNOWN:
                log.warning("%s: pod %s did not answer its flip to %s (%s): counted in %s "
                            "until its stats tell its role", where, name, role, answer.detail,
                            role)
            else:
                log.warning("%s: cannot flip pod %s to %s: %s", where, name, role,
                            answer.detail)
                ok = False
        for home, n in plan.replicas.items():
            was = self._replicas.get(home, n)
            if n != was:
                d = Decision(home, was, n, plan.reason, {})
                ok = await self.scale(report.Change(d, was, True), now) and ok
        return ok

    async def tell(self, tick: Tick) -> None:
        spec = self._spec()
        dry = spec.autoscaler.dry_run
        for d in tick.decisions:
            metrics.set_desired(spec.name, spec.namespace, d.role, d.desired, dry)
        # A role no longer autoscaled keeps no frozen desired-replicas series behind.
        metrics.forget(spec.name, spec.namespace, keep=[d.role for d in tick.decisions])
        if tick.status is not None:
            await asyncio.to_thread(self.kube.patch_status, spec.namespace, spec.name,
                                    {"autoscaler": dict(tick.status)})
        for change in tick.done:
            self.post_event(*report.event(change))
            log.info(report.log_line(f"{spec.namespace}/{spec.name}", change))
            metrics.count_decision(spec.name, spec.namespace, change.role, change.direction,
                                   not change.act)


class ServiceAutoscaler:
    """One LLMService's autoscaler: the one loop, its Kubernetes backend, Cleave's policy."""

    def __init__(self, kube: Kube, scrape_timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.backend = KubeBackend(kube, scrape_timeout_s)
        self.decider = PolicyDecider(PolicyConfig({}))
        self.loop = AutoscalerLoop(self.backend, self.decider)
        self._problem = ""

    async def run_once(self, obj: Mapping[str, Any], session: aiohttp.ClientSession,
                       now: float, post_event: PostEvent) -> float:
        """One tick of the loop for the LLMService ``obj``; returns the seconds to wait."""
        try:
            spec = parse_spec(obj)
        except SpecError:
            return 5.0  # the reconcile reports the spec; look again soon
        try:
            self.decider.config = config_from_spec(spec)
        except ValueError as e:  # e.g. the minimum replicas alone need more than the budget
            if str(e) != self._problem:
                log.warning("%s/%s: cannot autoscale: %s", spec.namespace, spec.name, e)
                self._problem = str(e)
            return interval_seconds(spec)
        self._problem = ""
        b = self.backend
        b.spec, b.session, b.post_event = spec, session, post_event
        self.loop.advisory = spec.autoscaler.dry_run
        if self.loop.told is None:  # after a restart: what the status already tells
            self.loop.told = (obj.get("status") or {}).get("autoscaler")
        await self.loop.tick(now)
        return interval_seconds(spec)
