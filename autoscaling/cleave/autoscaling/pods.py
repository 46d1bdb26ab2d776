"""A role's replicas as the autoscaler counts capacity, whoever runs them (pods or processes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodCounts:
    """A role's pods as the autoscaler counts capacity."""

    ready: int = 0  # serving now
    starting: int = 0  # scheduled (or about to be created), not ready: capacity on its way
    pending: int = 0  # unschedulable: asked for, but there is no room for it
