"""A worker's two roles: the home role it was started in (its Deployment's, or the one
``cleave up`` gave it) and the current role a flip sets (docs/autoscaling.md, "Elastic roles").

A flip is a lease that dies with the process: a restarted worker comes back in its home role,
so nothing outside the pod can hold a stale role for it. The worker's per-role gauges follow
the current role, so the metrics an autoscaler reads count the worker where it works now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cleave.runtime import metrics

ROLES = ("prefill", "decode", "both")
FLIPPABLE = ("prefill", "decode")  # "both" is a colocated worker: it already does everything


class RoleError(ValueError):
    """A flip that cannot be done; the message says why, ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def check_flip(home: str, draining: bool) -> None:
    """Whether a worker may flip at all (pure); the body's role is wire.RoleRequest's."""
    if home == "both":
        raise RoleError("a worker started in the both role serves both phases already", 409)
    if draining:
        raise RoleError("the worker is draining", 409)


class WorkerRoles:
    """The current role, and the worker's gauges labelled with it."""

    def __init__(self, home: str, gauges: dict[Any, Callable[[], float]]) -> None:
        if home not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {home!r}")
        self.home = home
        self.current = home
        self.flips = 0
        self._gauges = gauges  # metric -> the function its gauge reads
        self._bind(home)
        # Exported from the start: a worker that has served nothing reports 0 tokens (idle),
        # not nothing (unknown), so an autoscaler can scale it down.
        metrics.PROMPT_TOKENS.labels(home)
        metrics.GENERATION_TOKENS.labels(home)

    def _bind(self, role: str) -> None:
        for gauge, read in self._gauges.items():
            gauge.labels(role).set_function(read)

    def flip(self, role: str) -> str:
        """Become ``role``; returns the role before. The old role's gauges go (a scrape must
        not count this worker twice); its counters stay, as counters must."""
        before = self.current
        if role != before:
            for gauge in self._gauges:
                gauge.remove(before)
            self._bind(role)
            metrics.PROMPT_TOKENS.labels(role)
            metrics.GENERATION_TOKENS.labels(role)
            self.current = role
            self.flips += 1
        return before
