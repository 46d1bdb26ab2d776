"""Autoscaling benchmark: Cleave's policy against static peak provisioning, a concurrency HPA
and the llm-d SLO formula, in the simulator (docs/simulator.md), for a 70B-class model
(Llama-3-70B shape) on simulated H200s.

On the step trace (2 -> 10 -> 1 requests/s in equal thirds) and the bursty trace (gamma
arrivals whose mean rate is redrawn every 5 minutes), each over several seeds:

- static: the smallest fixed deployment that meets the SLO on >= 99 % of that trace's requests
  (found by simulation: peak provisioning done right), the GPU-hours reference;
- cleave, hpa, llmd: start warm (sized for the first minute) and follow the load.

SLO: TTFT <= 2 s and TPOT <= 50 ms per request. Cold start 90 s per replica.

    python bench/autoscale.py [--quick] [--cold-start S] [--tpot-slo S] [--seeds N]
                              [--png-dir DIR]

The last line is one JSON object: per policy, the worst attainment of the two traces and the
mean over the traces of GPU-hours relative to static (each trace's figure is a seed mean).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from cleave.operator.autoscaler.costmodel import build_cost_model
from cleave.operator.autoscaler.scenarios import run_policy, size_static
from cleave.operator.autoscaler.simulator import SimConfig, SimResult
from cleave.operator.autoscaler.traces import make_trace

TRACES = ("step", "bursty")
POLICIES = ("cleave", "llmd", "hpa")
MAX_REPLICAS = 12


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def one_trace(kind: str, seed: int, cfg: SimConfig, duration: float,
              png_dir: Path | None) -> dict[str, tuple[float, float]]:
    """(SLO attainment, GPU-hours over static) per policy, static included."""
    trace = make_trace(kind, duration, None, seed)
    (p, d), static = size_static(trace, cfg, MAX_REPLICAS)
    base = static.gpu_hours()
    log(f"{kind} seed {seed}: {len(trace.requests)} requests; static {p} prefill + {d} decode "
        f"meets {static.slo_attainment():.4f} with {base:.2f} GPU-hours")
    out = {"static": (static.slo_attainment(), 1.0)}
    results: dict[str, SimResult] = {"static": static}
    for policy in POLICIES:
        res = run_policy(policy, trace, cfg, MAX_REPLICAS)
        results[policy] = res
        out[policy] = (res.slo_attainment(), res.gpu_hours() / base)
        log(f"  {policy:6s} attainment {out[policy][0]:.4f}, GPU-hours {res.gpu_hours():.2f} "
            f"= {out[policy][1]:.2f} x static")
    if png_dir is not None:
        from cleave.operator.autoscaler.timeline import draw_timeline

        png_dir.mkdir(parents=True, exist_ok=True)
        for policy, res in results.items():
            draw_timeline(res, png_dir / f"{kind}-seed{seed}-{policy}.png")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two seeds instead of ten (< 2 min)")
    ap.add_argument("--cold-start", type=float, default=90.0, help="seconds per replica")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per trace (default 10; 2 quick)")
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds per trace")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="per-request TTFT SLO, s")
    ap.add_argument("--tpot-slo", type=float, default=0.05, help="per-request TPOT SLO, s")
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--png-dir", type=Path, default=None, help="write every run's timeline here")
    args = ap.parse_args()
    seeds = args.seeds or (2 if args.quick else 10)
    duration = args.duration
    cost = build_cost_model(args.gpu, "70b")
    cfg = SimConfig(cost, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo,
                    cold_start_s=args.cold_start)
    log(f"{cost.model.name} on {cost.gpu.name}: {cost.describe()}")
    log(f"{duration:g} s per trace, seeds 0..{seeds - 1}, cold start {args.cold_start:g} s")
    started = time.monotonic()
    per_trace: dict[str, dict[str, tuple[float, float]]] = {}
    for kind in TRACES:
        runs = [one_trace(kind, seed, cfg, duration, args.png_dir) for seed in range(seeds)]
        per_trace[kind] = {
            policy: (statistics.fmean(r[policy][0] for r in runs),
                     statistics.fmean(r[policy][1] for r in runs))
            for policy in ("static", *POLICIES)}
    print(f"{'trace':8s} {'policy':7s} {'SLO attainment':>15s} {'GPU-h / static':>15s}")
    for kind, rows in per_trace.items():
        for policy, (att, ratio) in rows.items():
            print(f"{kind:8s} {policy:7s} {att:15.4f} {ratio:15.2f}")
    log(f"done in {time.monotonic() - started:.0f} s")
    figures: dict[str, float] = {}
    for policy in POLICIES:
        figures[f"{policy}_slo_attainment"] = round(
            min(per_trace[k][policy][0] for k in TRACES), 4)
        figures[f"{policy}_gpu_hours_over_static"] = round(
            statistics.fmean(per_trace[k][policy][1] for k in TRACES), 3)
    # The reference itself: static may give up short of its goal at MAX_REPLICAS per role,
    # and every ratio above is over it.
    figures["static_slo_attainment"] = round(min(per_trace[k]["static"][0] for k in TRACES), 4)
    if figures["static_slo_attainment"] < 0.99:
        log("static provisioning missed its 0.99 goal at the replica limit: the GPU-hour "
            "ratios are over a deployment that fails the SLO")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
