"""``cleave simulate``: a role-split deployment under a trace, autoscaled by a chosen policy."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from cleave.autoscaling.costmodel import GPUS, MODELS
from cleave.autoscaling.scenarios import POLICIES
from cleave.autoscaling.traces import DEFAULT_RATES, TRACES

_EPILOG = """\
The cost model is DESIGN.md's arithmetic with datasheet peaks and stated achieved fractions
(docs/simulator.md). The autoscaler sees only what a scraper of the workers' /metrics would
see, every --interval seconds; Cleave's policy is the operator's own code.

examples:
  cleave simulate --trace step --duration 1800 --png step.png
  cleave simulate --trace bursty --policy llmd --json out.json
  cleave simulate --trace my_trace.jsonl --gpu H100 --cold-start 60
"""


def add_simulate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="simulate autoscaling of a prefill/decode deployment under a trace",
        description="Discrete-event simulation of a role-split deployment under a trace: SLO "
                    "attainment, replica-hours per role and a PNG timeline.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="step",
                   help=f"{', '.join(TRACES)}, or a JSONL file of {{arrival_s, prompt_tokens, "
                        "output_tokens} lines (default step: 2 -> 10 -> 1 req/s)")
    p.add_argument("--gpu", default="H200",
                   help=f"{', '.join(GPUS)}, local (measured now) or a JSON file of constants")
    p.add_argument("--model", default="70b",
                   help=f"model shape: {', '.join(sorted(MODELS))} (default 70b: Llama-3-70B), "
                        "or the path of a Hugging Face config.json (or its folder)")
    p.add_argument("--prefill-gpus", type=int, default=None,
                   help="GPUs per prefill replica (tensor parallel; default: fits the weights)")
    p.add_argument("--decode-gpus", type=int, default=None, help="GPUs per decode replica")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of trace (default 3600; a JSONL trace: all of it)")
    p.add_argument("--rate", type=float, default=None,
                   help="mean requests/s (step: the peak); default "
                        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_RATES.items()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="per-request TTFT SLO, s")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="per-request TPOT SLO, s")
    p.add_argument("--cold-start", type=float, default=90.0,
                   help="seconds from scheduling a replica to serving (default 90)")
    p.add_argument("--interval", type=float, default=15.0, help="autoscaler period, s")
    p.add_argument("--flip-time", type=float, default=5.0,
                   help="seconds a live role flip stops a worker's intake (default 5)")
    p.add_argument("--interference", type=float, default=None,
                   help="share of a prefill chunk's compute not hidden in a decode step "
                        "(0: roofline, 1: additive; default 0.3)")
    p.add_argument("--no-convertible", action="store_true",
                   help="turn off the router's convertible rules (backlog to decode workers, "
                        "prefill workers serving whole)")
    p.add_argument("--policy", default="cleave", choices=POLICIES)
    p.add_argument("--static-replicas", default=None, metavar="P,D",
                   help="static policy: prefill,decode replicas (default: capacity model at "
                        "the trace's peak minute)")
    p.add_argument("--max-replicas", type=int, default=12, help="per-role maximum")
    p.add_argument("--png", default=None, help="write the timeline here")
    p.add_argument("--json", default=None, help="write the summary here ('-': stdout)")
    p.set_defaults(func=run_simulate)


def _static(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--static-replicas wants PREFILL,DECODE, got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError("--static-replicas: each role needs at least one replica")
    return p, d


def _progress(every_s: float = 5.0) -> Callable[[float, float], None]:
    last = [time.monotonic()]

    def report(now: float, total: float) -> None:
        if time.monotonic() - last[0] >= every_s:
            last[0] = time.monotonic()
            print(f"  simulated {now:.0f}/{total:.0f} s", file=sys.stderr, flush=True)
    return report


def run_simulate(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:
        print(f"cleave simulate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from cleave.autoscaling.costmodel import build_cost_model
    from cleave.autoscaling.scenarios import run_policy
    from cleave.autoscaling.simulator import SimConfig
    from cleave.autoscaling.traces import make_trace

    for name in ("duration", "rate", "ttft_slo", "tpot_slo", "interval"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.cold_start < 0 or args.max_replicas < 1:
        raise ValueError("--cold-start must be >= 0 and --max-replicas >= 1")
    static = _static(args.static_replicas)
    cost = build_cost_model(args.gpu, args.model, args.prefill_gpus, args.decode_gpus)
    if args.interference is not None:
        if not 0 <= args.interference <= 1:
            raise ValueError("--interference must be within 0..1")
        cost = replace(cost, interference=args.interference)
    if args.flip_time < 0:
        raise ValueError("--flip-time must be >= 0")
    duration = args.duration if args.duration or args.trace not in TRACES else 3600.0
    trace = make_trace(args.trace, duration, args.rate, args.seed)
    if not trace.requests:
        raise ValueError(f"trace {args.trace!r} has no requests in {trace.duration:g} s")
    cfg = SimConfig(cost, args.ttft_slo, args.tpot_slo, args.cold_start, args.interval,
                    flip_s=args.flip_time, convertible=not args.no_convertible)
    print(f"simulating {len(trace.requests)} requests over {trace.duration:g} s of "
          f"{trace.name} with {args.policy} on {cost.model.name} / {cost.gpu.name} "
          f"({cost.prefill_tp} GPUs per prefill, {cost.decode_tp} per decode replica)",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    result = run_policy(args.policy, trace, cfg, args.max_replicas, static, _progress())
    summary = result.summary()
    summary["wall_s"] = round(time.monotonic() - started, 2)
    hours = summary["replica_hours"]
    assert isinstance(hours, dict)
    print(f"policy {args.policy} on {trace.name}: {summary['requests']} requests, "
          f"SLO attainment {summary['slo_attainment']} (TTFT <= {cfg.ttft_slo:g} s: "
          f"{summary['ttft_attainment']}, TPOT <= {cfg.tpot_slo:g} s: "
          f"{summary['tpot_attainment']})")
    print(f"  GPU-hours {summary['gpu_hours']}; replica-hours prefill {hours['prefill']}, "
          f"decode {hours['decode']}; peak replicas {summary['max_replicas']}")
    print(f"  p90 TTFT {summary['ttft_p90_s']} s, p90 TPOT {summary['tpot_p90_s']} s; "
          f"{len(result.reasons)} scaling decisions; simulated in {summary['wall_s']} s")
    if args.png:
        from cleave.autoscaling.timeline import draw_timeline

        print(f"  timeline: {draw_timeline(result, args.png)}")
    if args.json == "-":
        print(json.dumps(summary))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"  summary: {args.json}")
    return 0
