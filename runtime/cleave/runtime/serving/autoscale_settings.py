"""``cleave up --autoscale``'s flags and the settings they make: bounds, SLO targets and
windows per role, checked before anything starts (a bad flag is a ValueError naming it)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from cleave.autoscaling.policy import DECODE, PREFILL, FloorPolicy, PolicyConfig, RolePolicy

DEFAULT_HOLD_SECONDS = 60.0  # a local cold start takes seconds; leave room on a busy machine
_DEFAULTS = {"ttft_slo": 1.0, "tpot_slo": 0.1, "kv_watermark": 0.8, "autoscale_interval": 5.0,
             "scale_up_window": 0.0, "scale_down_window": 60.0, "metrics_window": 30.0}
_ONLY_WITH_AUTOSCALE = ("prefill_min", "prefill_max", "decode_min", "decode_max", *_DEFAULTS,
                        "scale_to_zero", "advisory", "autoscale_metrics_port", "no_flips")


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "autoscaling", "With --autoscale, worker processes are started and stopped by the same "
        "policy the Kubernetes operator runs; --prefill and --decode are the starting counts.")
    g.add_argument("--autoscale", action="store_true",
                   help="scale each role between its min and max on its SLO signal")
    g.add_argument("--advisory", action="store_true",
                   help="dry run: log every decision, start and stop nothing")
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-min", type=int, default=None, metavar="N",
                       help=f"fewest {role} workers (default 1; 0 with --scale-to-zero)")
        g.add_argument(f"--{role}-max", type=int, default=None, metavar="N",
                       help=f"most {role} workers (default 2" +
                            ("; 0 when --prefill 0: colocated)" if role == "prefill" else ")"))
    g.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="prefill target: p90 time to first token (default 1.0; 0: none)")
    g.add_argument("--tpot-slo", type=float, default=None, metavar="SECONDS",
                   help="decode target: p90 time per output token (default 0.1; 0: none)")
    g.add_argument("--kv-watermark", type=float, default=None, metavar="RATIO",
                   help="decode target: mean KV cache usage (default 0.8; 0: none)")
    g.add_argument("--no-flips", action="store_true",
                   help="meet a role's shortfall only by starting workers, never by flipping "
                        "a warm worker of the other role, and never go down to one worker "
                        "serving both roles at low load (docs/autoscaling.md, Elastic roles)")
    g.add_argument("--scale-to-zero", action="store_true",
                   help="idle roles may stop every worker (minimums default to 0); the router "
                        "holds requests meanwhile and its queue wakes them")
    g.add_argument("--autoscale-interval", type=float, default=None, metavar="SECONDS",
                   help="seconds between decisions (default 5)")
    g.add_argument("--scale-up-window", type=float, default=None, metavar="SECONDS",
                   help="scale up only as far as every decision in this window agrees "
                        "(default 0: at once)")
    g.add_argument("--scale-down-window", type=float, default=None, metavar="SECONDS",
                   help="scale down only as far as every decision in this window agrees "
                        "(default 60)")
    g.add_argument("--metrics-window", type=float, default=None, metavar="SECONDS",
                   help="p90 latencies and token rates over this many seconds (default 30)")
    g.add_argument("--autoscale-metrics-port", type=int, default=None, metavar="PORT",
                   help="serve the autoscaler's metrics (desired replicas, decisions) on this "
                        "port (default: a free one, printed at start)")


@dataclass(frozen=True)
class AutoscaleSettings:
    policy: PolicyConfig
    worker_roles: Mapping[str, str]  # policy role -> the worker role its processes run
    initial: Mapping[str, int]  # policy role -> workers to start with
    interval_s: float
    metrics_window_s: float
    advisory: bool
    hold_timeout_s: float
    metrics_port: int = 0  # 0: a free one
    # Flip warm workers between prefill and decode before starting or stopping any (only
    # with both roles: a colocated `both` worker has nothing to flip).
    flips: bool = True


def _clamp(n: int, low: int, high: int) -> int:
    return min(max(n, low), high)


def settings_from_args(args: argparse.Namespace) -> AutoscaleSettings | None:
    """The autoscaling settings (None without --autoscale); ValueError naming the bad flag."""
    if not args.autoscale:
        given = [k for k in _ONLY_WITH_AUTOSCALE if getattr(args, k) not in (None, False)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --autoscale")
        return None
    v = {k: _DEFAULTS[k] if getattr(args, k) is None else float(getattr(args, k))
         for k in _DEFAULTS}
    if v["autoscale_interval"] <= 0 or v["metrics_window"] <= 0:
        raise ValueError("--autoscale-interval and --metrics-window must be > 0")
    for k in ("ttft_slo", "tpot_slo", "kv_watermark", "scale_up_window", "scale_down_window"):
        if v[k] < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 0")
    if v["kv_watermark"] > 1:
        raise ValueError("--kv-watermark is a ratio of the KV pool: at most 1")
    low = 0 if args.scale_to_zero else 1
    bounds: dict[str, tuple[int, int]] = {}
    for role, start in ((PREFILL, args.prefill), (DECODE, args.decode)):
        default_max = 0 if role == PREFILL and start == 0 else 2
        high = default_max if getattr(args, f"{role}_max") is None else getattr(args, f"{role}_max")
        given_min = getattr(args, f"{role}_min")
        least = min(low, high) if given_min is None else given_min
        if not 0 <= least <= high:
            raise ValueError(f"need 0 <= --{role}-min ({least}) <= --{role}-max ({high})")
        bounds[role] = (least, high)
    if bounds[DECODE][1] < 1:
        raise ValueError("--decode-max must be at least 1: decode workers serve every request")
    up, down = v["scale_up_window"], v["scale_down_window"]
    roles = {DECODE: RolePolicy(*bounds[DECODE], latency_target=v["tpot_slo"] or None,
                                kv_watermark=v["kv_watermark"] or None, up_window_s=up,
                                down_window_s=down)}
    if bounds[PREFILL][1] > 0:
        roles[PREFILL] = RolePolicy(*bounds[PREFILL], latency_target=v["ttft_slo"] or None,
                                    up_window_s=up, down_window_s=down)
    hold = DEFAULT_HOLD_SECONDS if args.hold_timeout is None else args.hold_timeout
    if hold < 0:
        raise ValueError("--hold-timeout must be >= 0")
    metrics_port = args.autoscale_metrics_port or 0
    if not 0 <= metrics_port < 65536:
        raise ValueError("--autoscale-metrics-port must be a TCP port (0: a free one)")
    flips = not args.no_flips and PREFILL in roles
    return AutoscaleSettings(
        # The one-worker floor needs flips (a worker turned to both roles); it removes a worker,
        # so it waits the scale-down window, as any scale-down does.
        policy=PolicyConfig(roles, scale_to_zero=args.scale_to_zero,
                            floor=FloorPolicy(hold_s=down) if flips else None),
        worker_roles={PREFILL: PREFILL, DECODE: DECODE} if PREFILL in roles else {DECODE: "both"},
        initial={PREFILL: _clamp(args.prefill, *bounds[PREFILL]),
                 DECODE: _clamp(args.decode, *bounds[DECODE])},
        interval_s=v["autoscale_interval"], metrics_window_s=v["metrics_window"],
        advisory=args.advisory, hold_timeout_s=hold, metrics_port=metrics_port,
        flips=flips)


def describe_settings(s: AutoscaleSettings) -> str:
    parts = []
    for role, p in sorted(s.policy.roles.items()):
        targets = [f"{'ttft' if role == PREFILL else 'tpot'} p90 <= {p.latency_target:g} s"
                   if p.latency_target else "", f"kv <= {p.kv_watermark:g}" if p.kv_watermark
                   else ""]
        parts.append(f"{s.worker_roles[role]} {p.min_replicas}..{p.max_replicas} "
                     f"({', '.join(t for t in targets if t) or 'capacity only'})")
    mode = "advisory (decisions are logged, nothing changes)" if s.advisory else "acting"
    if s.flips:
        mode += ", flipping warm workers between roles first"
    return (f"autoscaling {'; '.join(parts)} every {s.interval_s:g} s, {mode}; scale to zero "
            f"{'on' if s.policy.scale_to_zero else 'off'}; requests held up to "
            f"{s.hold_timeout_s:g} s while no worker is ready")
