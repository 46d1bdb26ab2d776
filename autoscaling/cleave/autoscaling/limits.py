"""The limits every decision is fitted to after the signals have spoken (pure): zero is all or
nothing, each role's bounds, the prefill/decode ratio guard and the GPU budget. Each limit that
changes a role's count appends why to that role's reasons."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cleave.autoscaling.roles import DECODE, PREFILL

if TYPE_CHECKING:
    from cleave.autoscaling.policy import PolicyConfig

EPS = 1e-9  # float noise in replica arithmetic: ceil(3.0000000000000004) must be 3, not 4


def fit_limits(want: dict[str, int], why: dict[str, list[str]],
               cfg: PolicyConfig) -> dict[str, int]:
    """``want`` (per role) within the config's limits, in this order: zero, bounds, ratio,
    budget (the guard and the budget only trim, so neither can break a bound)."""
    roles = sorted(want)
    if any(want[r] > 0 for r in roles):
        # Zero is all or nothing: a request needs every role, so once one role runs (or wakes
        # on demand) the others come up with it; without scale_to_zero nothing reaches zero.
        _at_least_one(want, why, cfg, "kept at 1: another role is serving")
    if not cfg.scale_to_zero:
        _at_least_one(want, why, cfg, "scale to zero disabled")
    for r in roles:
        p = cfg.roles[r]
        bounded = min(max(want[r], p.min_replicas), p.max_replicas)
        if bounded != want[r]:
            why[r].append(f"bounded to [{p.min_replicas}, {p.max_replicas}]")
        want[r] = bounded
    if cfg.ratio_bounds is not None and want.get(PREFILL, 0) > 0 and want.get(DECODE, 0) > 0:
        # The guard only trims (never below min), so it cannot break max or the budget; it stops
        # one role's noisy signal from growing it far out of proportion to the other.
        lo, hi = cfg.ratio_bounds
        for r, cap in ((PREFILL, max(1, math.floor(hi * want[DECODE] + EPS))),
                       (DECODE, max(1, math.floor(want[PREFILL] / lo + EPS)))):
            trimmed = max(cfg.roles[r].min_replicas, min(want[r], cap))
            if trimmed != want[r]:
                want[r] = trimmed
                why[r].append(f"ratio guard {lo:g}..{hi:g} trims to {trimmed}")
    if cfg.gpu_budget is not None:
        fitted = _fit_budget(want, cfg)
        for r in roles:
            if fitted[r] != want[r]:
                why[r].append(f"gpu budget {cfg.gpu_budget} trims to {fitted[r]}")
        want = fitted
    return want


def _at_least_one(want: dict[str, int], why: dict[str, list[str]], cfg: PolicyConfig,
                  reason: str) -> None:
    for r in sorted(want):
        if want[r] == 0 and cfg.roles[r].max_replicas > 0:
            want[r] = 1
            why[r].append(reason)


def _fit_budget(want: dict[str, int], cfg: PolicyConfig) -> dict[str, int]:
    """Water-fill the GPU budget from every role's minimum: each GPU goes to the role furthest
    (relatively) from what it wants, so a shortage is shared instead of starving one role."""
    roles = cfg.roles
    got = {r: min(want[r], roles[r].min_replicas) for r in want}
    left = (cfg.gpu_budget or 0) - sum(got[r] * roles[r].gpus_per_replica for r in got)
    while True:
        fits = [r for r in sorted(got) if got[r] < want[r] and roles[r].gpus_per_replica <= left]
        if not fits:
            return got
        r = max(fits, key=lambda k: (want[k] - got[k]) / want[k])
        got[r] += 1
        left -= roles[r].gpus_per_replica


__all__ = ["fit_limits"]
