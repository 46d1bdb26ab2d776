"""Elastic roles: which warm workers flip role, and which replicas to start or stop (pure).

Every worker holds the whole model and can run both phases. A pod has a *home role* (the
Deployment that owns it, whose replica count the operator keeps) and a *current role*, runtime
state the autoscaler sets by a flip and the router reads from the worker's stats. A flip takes
seconds where a new replica takes a cold start, so the plan covers a role's shortfall first by
flipping workers the other role can spare, and starts replicas only for what flips cannot cover.
At low load one worker serving ``both`` roles is the floor: an idle-ish service costs one
replica, not one per role.

:func:`plan_flips` is what the operator and ``cleave up --autoscale`` call after the per-role
policy (:func:`cleave.autoscaling.policy.decide`); the simulator calls the same function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cleave.autoscaling.roles import DECODE, PREFILL

BOTH = "both"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class WorkerView:
    """One worker as the planner sees it: from the pod (home, ready) and its stats (role)."""

    name: str
    home: str  # prefill or decode: the Deployment that owns the pod
    role: str  # prefill, decode or both: what it serves now (a flip in progress: the new role)
    ready: bool  # serving (a starting pod comes back in its home role)
    load: float = 0.0  # requests in flight, to pick the cheapest worker to flip or remove


@dataclass(frozen=True)
class FlipPlan:
    """What to do now. ``replicas``: each home Deployment's replica count after the plan
    (kept pods by home plus new ones); ``remove``: the pods to delete, named, so the backend
    removes these (Kubernetes: lowest pod-deletion-cost first), not whichever it would pick."""

    flips: tuple[tuple[str, str], ...]  # (worker, new role)
    start: Mapping[str, int]  # new replicas per home role
    remove: tuple[str, ...]
    replicas: Mapping[str, int]
    reason: str


def _pick(workers: Sequence[WorkerView], n: int, prefer_home: str | None) -> list[WorkerView]:
    """The ``n`` cheapest workers: ready ones whose home is ``prefer_home`` first (a flip back
    home), then the least loaded."""
    ranked = sorted(workers, key=lambda w: (w.home != prefer_home, w.load, w.name))
    return ranked[:n]


def _colocated(workers: Sequence[WorkerView]) -> FlipPlan:
    ready = [w for w in workers if w.ready]
    if not ready:  # keep everything until one is up to carry the load
        return FlipPlan((), {}, (), _by_home(workers, {}), "floor: waiting for a ready worker")
    keep = sorted(ready, key=lambda w: (w.role != BOTH, -w.load, w.name))[0]
    flips = ((keep.name, BOTH),) if keep.role != BOTH else ()
    remove = tuple(w.name for w in workers if w.name != keep.name)
    return FlipPlan(flips, {}, remove, _by_home([keep], {}),
                    f"floor: one worker ({keep.name}) serves both roles")


def _by_home(kept: Sequence[WorkerView], start: Mapping[str, int]) -> dict[str, int]:
    return {h: sum(w.home == h for w in kept) + start.get(h, 0) for h in ROLES}


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def _bridged(desired: Mapping[str, int], have: Mapping[str, list[WorkerView]],
             bridge: WorkerView | None) -> dict[str, int]:
    """Workers to keep per current role, the bridge counted in its home role (it goes back
    there). The backends count a both-worker in both roles, so the
    policy's count of the role the bridge leaves includes it: that role gets its own workers
    in full once, while it has none (replacing the bridge's share), and one fewer than the
    policy's count after that, so a steady count does not start a replica every interval. Nor
    does it remove one of that role's starting workers while it bridges (they are the bridge's
    relief: removing one there started it again once the bridge ended)."""
    want = {r: desired.get(r, 0) for r in ROLES}
    if bridge is None:
        return want
    other = _other(bridge.home)
    if have[other]:
        want[other] = max(want[other] - 1, len(have[other]))
    return want


def plan_flips(desired: Mapping[str, int], workers: Sequence[WorkerView],
               colocate: bool = False) -> FlipPlan:
    """Meet ``desired`` workers per current role (prefill, decode) from ``workers`` (the live
    ones, draining excluded): flip ready workers one role can spare to the role short of them,
    start new replicas (in the role short of them) only for what is left, and remove what
    remains over. ``colocate``: the load fits one worker, which then serves both roles."""
    if colocate:
        return _colocated(workers)
    # A both-worker (left from the floor) serves whichever role is short, else goes home.
    role_of = {w.name: w.role if w.ready else w.home for w in workers}
    have = {r: [w for w in workers if role_of[w.name] == r] for r in ROLES}
    flexible = [w for w in workers if role_of[w.name] == BOTH]
    # Leaving the floor: the both-worker keeps serving both roles until the role it leaves
    # has a ready worker of its own, so no request waits for a cold start meanwhile.
    bridge = flexible.pop(0) if flexible and not any(
        w.ready for w in have[_other(flexible[0].home)]) else None
    if bridge is not None:
        have[bridge.home].append(bridge)
    want = _bridged(desired, have, bridge)
    flips: list[tuple[str, str]] = []
    homes = {w.home for w in flexible}
    for r in sorted(ROLES, key=lambda r: (len(have[r]) - want[r], r not in homes)):
        short = want[r] - len(have[r])
        for w in _pick(flexible, max(0, short), r):
            flexible.remove(w)
            have[r].append(w)
            flips.append((w.name, r))
    for w in flexible:
        have[w.home].append(w)
        flips.append((w.name, w.home))
    for r, other in ((PREFILL, DECODE), (DECODE, PREFILL)):
        short = want[r] - len(have[r])
        spare = len(have[other]) - want[other]
        movable = [w for w in have[other] if w.ready and w is not bridge
                   and (w.name, other) not in flips]
        for w in _pick(movable, max(0, min(short, spare)), r):
            have[other].remove(w)
            have[r].append(w)
            flips = [f for f in flips if f[0] != w.name] + [(w.name, r)]
    start = {r: max(0, want[r] - len(have[r])) for r in ROLES}
    remove: list[str] = []
    for r in ROLES:
        over = len(have[r]) - want[r]
        if over > 0:
            # Kubernetes' own order: not-ready pods first, then the least busy.
            gone = sorted((w for w in have[r] if w is not bridge),
                          key=lambda w: (w.ready, w.load, w.name))[:over]
            remove += [w.name for w in gone]
            have[r] = [w for w in have[r] if w not in gone]
    flips = [f for f in flips if f[0] not in remove]
    kept = [w for r in ROLES for w in have[r]]
    why = [f"{n} -> {r}" for n, r in flips] + [f"start {k} {r}" for r, k in start.items() if k]
    why += [f"remove {n}" for n in remove]
    return FlipPlan(tuple(flips), start, tuple(remove), _by_home(kept, start),
                    "; ".join(why) or "hold")
