"""Elastic roles on Kubernetes (docs/autoscaling.md): each ready worker pod's current role, read
from its ``/internal/stats``, and a :class:`~cleave.autoscaling.flips.FlipPlan` carried out —
flips by ``POST /internal/role`` on the pods, each home Deployment at the plan's replicas, and
the pods the plan removes marked cheapest to delete, so the ReplicaSet removes those.

The pod's home role is its Deployment's (its ``component`` label); its current role is runtime
state in the worker, which comes back home when the pod restarts. Nothing is stored in the API:
a flip the operator forgets (it restarts) is read back from the pods at the next tick. A busy
pod's stats may miss the timeout: the operator then takes the role that run of the pod's worker
container last told (:data:`Said`), not its home role, which would count a flipped pod in the
role it left (and plan a new replica, or a second flip, for the role it serves). A flip whose
answer never came counts too (:func:`after_flip`): a busy worker may switch and answer late.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from cleave.autoscaling.flips import BOTH, WorkerView
from cleave.autoscaling.pods import PodCounts
from cleave.operator.status import is_ready, live_pods

# The ReplicaSet deletes pods with the lowest cost first on a scale-down (Kubernetes >= 1.22).
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """``http://<podIP>:<port named http>`` of a ready pod, else None."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or not is_ready(pod):
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{port['containerPort']}"
    return None


def _name(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"]["name"])


# (pod uid, restarts of its worker container) -> the role that run of the worker last told.
# One run: a restarted container is a new process, back in its home role.
Said = Mapping[tuple[str, int], str]


def container_run(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    """The key of :data:`Said` for ``pod``: its uid and its worker container's (the one
    serving ``http``) restartCount; None without a uid."""
    uid = pod["metadata"].get("uid")
    if not uid:
        return None
    serving = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []
               if any(p.get("name") == "http" for p in c.get("ports") or [])]
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    restarts = [int(c.get("restartCount") or 0) for c in statuses if c.get("name") in serving]
    return str(uid), sum(restarts)


async def reported_roles(session: aiohttp.ClientSession,
                         pods: Mapping[str, Sequence[Mapping[str, Any]]],
                         timeout_s: float, auth: Mapping[str, str]) -> dict[str, str]:
    """Pod name -> the role its worker reports, for every ready pod that answers in time."""
    async def one(pod: Mapping[str, Any]) -> tuple[str, str | None]:
        url = pod_url(pod)
        if url is None:
            return _name(pod), None
        try:
            async with session.get(url + "/internal/stats", headers=auth,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                stats = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
            stats = {}
        role = stats.get("role") if isinstance(stats, dict) else None
        return _name(pod), str(role) if role in ("prefill", "decode", "both") else None

    found = await asyncio.gather(*(one(p) for ps in pods.values() for p in live_pods(ps)))
    return {name: role for name, role in found if role is not None}


def roles_now(pods: Mapping[str, Sequence[Mapping[str, Any]]], reported: Mapping[str, str],
              said: Said) -> tuple[dict[str, str], dict[tuple[str, int], str]]:
    """Pod name -> current role of every live pod: what it reported now, else what this run
    of its worker last told, else its home role (a pod never heard from: it starts there).
    Also the new :data:`Said`, of the live pods only (a gone pod's entry is dropped)."""
    roles, kept = {}, {}
    for home, ps in pods.items():
        for p in live_pods(ps):
            run, name = container_run(p), _name(p)
            known = said.get(run) if run is not None else None
            roles[name] = reported.get(name) or known or home
            if run is not None and (name in reported or known is not None):
                kept[run] = roles[name]
    return roles, kept


def by_current_role(counts: Mapping[str, PodCounts], pods: Mapping[str, Sequence[Any]],
                    roles: Mapping[str, str]) -> dict[str, PodCounts]:
    """Each role's counts with ready pods counted where they work now (starting and pending
    pods are in their home role)."""
    ready = {r: c.ready for r, c in counts.items()}
    for home, ps in pods.items():
        for p in live_pods(ps):
            now = roles.get(_name(p), home)
            if is_ready(p) and now == BOTH:  # the floor: ready in its home role and the other
                ready.update({r: n + 1 for r, n in ready.items() if r != home})
            elif is_ready(p) and now != home and now in ready and ready[home] > 0:
                ready[home] -= 1
                ready[now] += 1
    return {r: PodCounts(ready[r], c.starting, c.pending) for r, c in counts.items()}


def worker_views(pods: Mapping[str, Sequence[Mapping[str, Any]]],
                 roles: Mapping[str, str]) -> list[WorkerView]:
    return [WorkerView(_name(p), home, roles.get(_name(p), home) if is_ready(p) else home,
                       is_ready(p)) for home, ps in pods.items() for p in live_pods(ps)]


def auth(token: str | None) -> dict[str, str]:
    """The header of an ``/internal/*`` call: the service's internal token (the Secret the
    reconcile creates; workers refuse these paths without it)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class Outcome(enum.Enum):
    """What a flip's ``POST /internal/role`` tells of the worker's role."""

    TAKEN = "taken"  # 200: it serves the role asked
    REFUSED = "refused"  # another answer, or the request never reached it: its role is as was
    UNKNOWN = "unknown"  # sent, but no answer (a timeout, a dropped connection): either role


@dataclass(frozen=True)
class FlipAnswer:
    outcome: Outcome
    detail: str = ""  # why not taken


async def flip(session: aiohttp.ClientSession, pod: Mapping[str, Any], role: str,
               timeout_s: float, headers: Mapping[str, str]) -> FlipAnswer:
    """Ask one pod's worker to take ``role``."""
    url = pod_url(pod)
    if url is None:
        return FlipAnswer(Outcome.REFUSED, "not ready")
    try:
        async with session.post(url + "/internal/role", json={"role": role}, headers=headers,
                                # A connect of its own bound: without one, a pod that never
                                # answers the SYN ends as a plain timeout, read as unknown.
                                timeout=aiohttp.ClientTimeout(total=timeout_s,
                                                              sock_connect=timeout_s / 2)) as r:
            if r.status == 200:
                return FlipAnswer(Outcome.TAKEN)
            return FlipAnswer(Outcome.REFUSED, f"HTTP {r.status}: {(await r.text())[:200]}")
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
        return FlipAnswer(Outcome.REFUSED, type(e).__name__)  # no connection: nothing was sent
    except (aiohttp.ClientError, TimeoutError) as e:
        return FlipAnswer(Outcome.UNKNOWN, type(e).__name__)


def after_flip(said: Said, run: tuple[str, int] | None, role: str,
               outcome: Outcome) -> dict[tuple[str, int], str]:
    """The :data:`Said` after asking the worker of ``run`` (:func:`container_run`) to take
    ``role``. Taken: it serves ``role``. Unknown: a busy worker may have switched and answered
    too late, and its stats then miss the timeout too; in its home role the pod would get a
    second flip, or a new replica started, for the shortfall it may already meet. So it counts
    in ``role`` until its stats answer (:func:`roles_now`: what a pod reports wins), and a flip
    it never took is planned again then. Refused: nothing changed."""
    kept = dict(said)
    if run is not None and outcome is not Outcome.REFUSED:
        kept[run] = role
    return kept
