"""Can any setting of a load-following policy meet the autoscaling target? The frontier.

``bench/autoscale.py`` measures Cleave's policy at its defaults against the target (>= 0.99 SLO
attainment at <= 0.7 of static GPU-hours, worst of the step and bursty traces). This sweeps the
two knobs that trade GPU-hours for attainment, on the same traces, seeds and cost model:

- the capacity model's target utilization (headroom kept above the load), and
- a floor on prefill replicas (capacity held through the quiet first third of the step trace),

and runs an oracle beside them: replicas on a timetable made from the trace itself, up a cold
start before the load they serve arrives and down as soon as it has passed, sized by the same
capacity model per 15 s or 60 s window at 80 % or 70 % utilization. No deployment can run the
oracle; it shows what knowing the load in advance buys.

    python bench/autoscale_frontier.py [--quick] [--cold-start S] [--seeds N]

The last line is one JSON object: every point (worst attainment, mean GPU-hours over static),
the cheapest point of each family that meets the attainment goal, and whether any
load-following point meets the whole target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from cleave.autoscaling.baselines import Autoscaler
from cleave.autoscaling.costmodel import build_cost_model
from cleave.autoscaling.elastic import ElasticCleave
from cleave.autoscaling.policy import PREFILL, PolicyConfig
from cleave.autoscaling.scenarios import (
    cleave_config,
    run_oracle,
    size_static,
    warm_start,
)
from cleave.autoscaling.simulator import SimConfig, simulate
from cleave.autoscaling.traces import Trace, make_trace

TRACES = ("step", "bursty")
MAX_REPLICAS = 12
GOAL_ATTAINMENT = 0.99
GOAL_GPU_HOURS = 0.7
UTILIZATIONS = (0.8, 0.6, 0.45)
PREFILL_FLOORS = (1, 2, 3)
ORACLE_SETTINGS = ((60.0, 0.8), (60.0, 0.7), (15.0, 0.8), (15.0, 0.7))  # (window s, utilization)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def cleave_variant(base: PolicyConfig, utilization: float, prefill_floor: int) -> PolicyConfig:
    roles = {name: replace(p, target_utilization=utilization,
                           min_replicas=prefill_floor if name == PREFILL else p.min_replicas)
             for name, p in base.roles.items()}
    return replace(base, roles=roles)


def run(trace: Trace, cfg: SimConfig, autoscaler: Autoscaler,
        initial: tuple[int, int]) -> tuple[float, float]:
    res = simulate(trace, replace(cfg, initial=initial), autoscaler)
    return res.slo_attainment(), res.gpu_hours()


def one_trace(kind: str, seed: int, cfg: SimConfig, duration: float
              ) -> dict[str, tuple[float, float]]:
    """(attainment, GPU-hours over static) per point."""
    trace = make_trace(kind, duration, None, seed)
    _, static = size_static(trace, cfg, MAX_REPLICAS)
    base = static.gpu_hours()
    warm = warm_start(cfg, trace)
    points: dict[str, tuple[float, float]] = {}
    default = cleave_config(cfg, trace, MAX_REPLICAS)
    for u in UTILIZATIONS:
        for floor in PREFILL_FLOORS:
            policy = cleave_variant(default, u, floor)
            # Cleave as deployed: flips first and the one-worker floor (elastic.ElasticCleave).
            att, gpu_h = run(trace, cfg, ElasticCleave(policy), (max(warm[0], floor), warm[1]))
            points[f"cleave u={u} prefill>={floor}"] = (att, gpu_h / base)
    for window, u in ORACLE_SETTINGS:
        res = run_oracle(cfg, trace, u, window)
        points[f"oracle {window:g}s u={u}"] = (res.slo_attainment(), res.gpu_hours() / base)
    log(f"{kind} seed {seed}: " + ", ".join(f"{k} {a:.3f}/{g:.2f}" for k, (a, g) in points.items()))
    return points


def meets(attainment: float, gpu_hours: float) -> bool:
    return attainment >= GOAL_ATTAINMENT and gpu_hours <= GOAL_GPU_HOURS


def cheapest_meeting_goal(points: dict[str, tuple[float, float]], family: str
                          ) -> dict[str, object] | None:
    meeting = [(g, k, a) for k, (a, g) in points.items()
               if k.startswith(family) and a >= GOAL_ATTAINMENT]
    if not meeting:
        return None
    g, k, a = min(meeting)
    return {"point": k, "slo_attainment": round(a, 4), "gpu_hours_over_static": round(g, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed per trace (seconds)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per trace (default 3; 1 quick)")
    ap.add_argument("--cold-start", type=float, default=90.0, help="seconds per replica")
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds per trace")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    cfg = SimConfig(build_cost_model("H200", "70b"), cold_start_s=args.cold_start)
    started = time.monotonic()
    per_trace: dict[str, list[dict[str, tuple[float, float]]]] = {
        kind: [one_trace(kind, seed, cfg, args.duration) for seed in range(seeds)]
        for kind in TRACES}
    names = list(per_trace[TRACES[0]][0])
    points = {
        name: (min(statistics.fmean(seed_points[name][0] for seed_points in runs)
                   for runs in per_trace.values()),
               statistics.fmean(statistics.fmean(seed_points[name][1] for seed_points in runs)
                                for runs in per_trace.values()))
        for name in names}
    print(f"{'point':26s} {'worst attainment':>17s} {'GPU-h / static':>15s}")
    for name, (att, gpu_h) in points.items():
        mark = " <- meets the target" if meets(att, gpu_h) else ""
        print(f"{name:26s} {att:17.4f} {gpu_h:15.2f}{mark}")
    log(f"done in {time.monotonic() - started:.0f} s")
    reactive_meets = any(meets(a, g) for k, (a, g) in points.items() if k.startswith("cleave"))
    print(json.dumps({
        "points": {k: [round(a, 4), round(g, 3)] for k, (a, g) in points.items()},
        "cleave_cheapest_meeting_attainment": cheapest_meeting_goal(points, "cleave"),
        "oracle_cheapest_meeting_attainment": cheapest_meeting_goal(points, "oracle"),
        "load_following_meets_target": reactive_meets,
        "cold_start_s": args.cold_start, "seeds": seeds,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
