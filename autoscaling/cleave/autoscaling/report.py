"""Explainability of the autoscaler: pure functions from policy decisions to what is published —
which decisions count as a change, the ``status.autoscaler`` block, the Event and the log line.
Both scale backends use them: the operator (status, Events, logs) and ``cleave up --autoscale``
(its log), so the two tell and act on the same decisions in the same words.

Only a change of a role's desired replicas is published, never a tick: an idle service makes no
API writes, and the last decisions in the status stay the ones that mattered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cleave.autoscaling.policy import Decision

KEEP_DECISIONS = 10  # status.autoscaler.decisions holds this many, newest first


@dataclass(frozen=True)
class Change:
    """One role whose desired replicas moved; ``act``: scale its Deployment (not advisory)."""

    decision: Decision
    current: int  # the Deployment's replicas now
    act: bool

    @property
    def role(self) -> str:
        return self.decision.role

    @property
    def desired(self) -> int:
        return self.decision.desired

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down"


def changes(decisions: Sequence[Decision], replicas: Mapping[str, int],
            previous: Mapping[str, Any] | None, dry_run: bool) -> list[Change]:
    """The decisions worth publishing. Acting: those whose desired differs from the Deployment
    (someone scaling it by hand included). Advisory: those whose desired differs from the
    last advisory desired in ``previous`` (the status block), so a standing recommendation is
    told once, not at every tick."""
    published = dict((previous or {}).get("desiredReplicas") or {})
    advisory_before = bool((previous or {}).get("dryRun"))
    out = []
    for d in decisions:
        if d.role not in replicas:
            continue
        current = replicas[d.role]
        if not dry_run:
            if d.desired != current:
                out.append(Change(d, current, act=True))
            continue
        last = published.get(d.role, current) if advisory_before else current
        if d.desired != last:
            out.append(Change(d, current, act=False))
    return out


def entry(change: Change, time: str) -> dict[str, Any]:
    """One ``status.autoscaler.decisions`` item."""
    return {"time": time, "role": change.role, "current": change.current,
            "desired": change.desired, "reason": change.decision.reason,
            "advisory": not change.act, "inputs": dict(change.decision.inputs)}


def status_block(previous: Mapping[str, Any] | None, found: Sequence[Change],
                 desired: Mapping[str, int], dry_run: bool, time: str) -> dict[str, Any]:
    """The new ``status.autoscaler``: the latest desired replicas and the decisions, newest
    first, the last :data:`KEEP_DECISIONS` only (the status is not a log)."""
    old = list((previous or {}).get("decisions") or [])
    fresh = [entry(c, time) for c in found]
    return {"dryRun": dry_run, "desiredReplicas": dict(desired),
            "decisions": (fresh + old)[:KEEP_DECISIONS]}


def needs_write(previous: Mapping[str, Any] | None, found: Sequence[Change],
                dry_run: bool) -> bool:
    """A decision to tell, or the block says the wrong mode (dryRun was switched)."""
    return bool(found) or (previous is not None and bool(previous.get("dryRun")) != dry_run)


def event(change: Change) -> tuple[str, str]:
    """(reason, message) of the Kubernetes Event for one change; advisory ones say so."""
    verb = "ScaledUp" if change.direction == "up" else "ScaledDown"
    if not change.act:
        verb = "WouldScaleUp" if change.direction == "up" else "WouldScaleDown"
    prefix = "" if change.act else "advisory (dryRun): "
    return verb, (f"{prefix}{change.role} {change.current} -> {change.desired}: "
                  f"{change.decision.reason}")


def log_line(service: str, change: Change, role: str | None = None) -> str:
    """One line with everything behind a change, inputs included, for ``kubectl logs`` and
    ``cleave up``'s log. ``service`` may be empty (one platform per ``cleave up``); ``role``
    names the role as the backend runs it (``cleave up``'s colocated workers are ``both``)."""
    inputs = " ".join(f"{k}={v}" for k, v in sorted(change.decision.inputs.items()))
    mode = "advisory" if not change.act else "scale"
    who = " ".join(w for w in (service, role or change.role) if w)
    return (f"autoscaler {mode} {who} {change.current} -> {change.desired}"
            f" ({change.decision.reason}) {inputs}")
