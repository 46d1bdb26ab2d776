"""The one-worker floor (issue 18): at low load one worker serving both roles, so an idle-ish
service costs one replica, not one per role. Pure: the policy (:func:`cleave.autoscaling.policy.
decide`) calls these every interval and keeps the hold's clock in its state; the flip planner
(:func:`cleave.autoscaling.flips.plan_flips`) carries the result out in every backend.
"""

from __future__ import annotations

from collections.abc import Mapping

from cleave.autoscaling.roles import DECODE, PREFILL


def one_worker_fits(prefill_demand: float | None, prefill_tput: float | None,
                    decode_demand: float | None, decode_tput: float | None,
                    utilization: float) -> bool:
    """Whether one colocated worker serves the load: the shares of a replica's capacity the two
    phases need add up to at most ``utilization`` (they share one GPU group's time). Unknown
    demand never colocates: the floor is taken only on evidence of low load."""
    if None in (prefill_demand, decode_demand) or not prefill_tput or not decode_tput:
        return False
    assert prefill_demand is not None and decode_demand is not None
    return prefill_demand / prefill_tput + decode_demand / decode_tput <= utilization


def floor_fits(desired: Mapping[str, int], prefill_demand: float | None,
               prefill_tput: float | None, decode_demand: float | None,
               decode_tput: float | None, utilization: float) -> bool | None:
    """Whether this interval's load fits the one-worker floor: False when the policy wants more
    than one worker in a role, None when a demand is unknown (a new pod has no rate yet)."""
    if desired.get(PREFILL, 0) > 1 or desired.get(DECODE, 0) > 1:
        return False
    if prefill_demand is None or decode_demand is None:
        return None
    return one_worker_fits(prefill_demand, prefill_tput, decode_demand, decode_tput,
                           utilization)


def floor_hold(now: float, fits: bool | None, since: float | None,
               hold_s: float) -> tuple[bool, float | None]:
    """(take the floor now, since when the load has fitted): the floor only after the load has
    fitted for ``hold_s`` straight, left at the first interval it does not; unknown changes
    nothing. The caller keeps ``since`` between intervals (the operator in its state)."""
    if fits is False:
        return False, None
    if fits and since is None:
        since = now
    return since is not None and now - since >= hold_s, since
