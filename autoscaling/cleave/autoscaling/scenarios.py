"""How each autoscaler is configured for a simulated deployment, and static peak sizing.

All four get the same per-role bounds. Cleave's targets are derived from the per-request SLOs
(not tuned per trace): TTFT p90 target = SLO / 2, because a queueing delay's tail is close to
exponential, where p99 = 2 x p90, so a p90 at half the SLO keeps about 99 % of requests inside
it; TPOT p90 target = 0.8 x SLO, because a decode step's time barely varies between requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from cleave.autoscaling.baselines import (
    Autoscaler,
    CleaveAutoscaler,
    HpaConcurrency,
    StaticAutoscaler,
)
from cleave.autoscaling.convertible import ConvertiblePrefill, prefill_replicas
from cleave.autoscaling.elastic import ElasticCleave, ElasticOracle
from cleave.autoscaling.floor import one_worker_fits
from cleave.autoscaling.llmd import LlmdSloFormula
from cleave.autoscaling.policy import (
    DECODE,
    PREFILL,
    FloorPolicy,
    KvProjection,
    PolicyConfig,
    RolePolicy,
)
from cleave.autoscaling.simulator import SimConfig, SimResult, simulate
from cleave.autoscaling.traces import Trace

POLICIES = ("cleave", "llmd", "hpa", "static")
TTFT_TARGET_SHARE = 0.5
KV_WATERMARK = 0.8
UTILIZATION = 0.8
FLOOR_UTILIZATION = FloorPolicy().utilization  # the policy's floor, for the oracle too


def mean_lengths(trace: Trace) -> tuple[float, float]:
    """Mean prompt and output tokens: measured from the trace (what an operator would know
    from its own traffic), the distribution's mean for an empty trace."""
    if not trace.requests:
        return trace.prompts.mean, trace.outputs.mean
    n = len(trace.requests)
    return (sum(r.prompt_tokens for r in trace.requests) / n,
            sum(r.output_tokens for r in trace.requests) / n)


def cleave_config(cfg: SimConfig, trace: Trace, max_replicas: int) -> PolicyConfig:
    cost = cfg.cost
    mean_in, mean_out = mean_lengths(trace)
    pre = RolePolicy(1, max_replicas, latency_target=TTFT_TARGET_SHARE * cfg.ttft_slo,
                     gpus_per_replica=cost.prefill_tp, target_utilization=UTILIZATION,
                     prior_throughput=cost.prefill_tokens_per_second(),
                     startup_s=cfg.cold_start_s)
    dec = RolePolicy(1, max_replicas, latency_target=cfg.decode_step_s(),
                     kv_watermark=KV_WATERMARK, gpus_per_replica=cost.decode_tp,
                     target_utilization=UTILIZATION,
                     prior_throughput=cost.decode_tokens_per_second(mean_in + mean_out / 2),
                     startup_s=cfg.cold_start_s,
                     kv_projection=KvProjection(
                         mean_in, mean_out, cost.model.kv_bytes_per_token,
                         cost.kv_capacity_tokens() * cost.model.kv_bytes_per_token,
                         KV_WATERMARK))
    return PolicyConfig({PREFILL: pre, DECODE: dec}, convertible=convertible_prefill(cfg))


def convertible_prefill(cfg: SimConfig) -> ConvertiblePrefill | None:
    """The prefill capacity decode workers lend under this router: its backlog rule sends late
    prompts to them whole (none without the convertible rules, or in an aggregated pool)."""
    if not cfg.convertible or cfg.aggregated:
        return None
    return ConvertiblePrefill(cfg.decode_budget(), cfg.decode_step_s())


def hpa_targets(cfg: SimConfig, trace: Trace) -> dict[str, float]:
    """Requests in flight per replica at the same 80 % utilization Cleave aims for: prefill by
    Pollaczek-Khinchine for an M/G/1 queue with the trace's prompt-time variability, decode as
    80 % of the sequences whose KV fits (or of the batch limit)."""
    cost = cfg.cost
    times = [cost.prefill_seconds(r.prompt_tokens) for r in trace.requests] or [1.0]
    mean = sum(times) / len(times)
    cs2 = sum((t - mean) ** 2 for t in times) / len(times) / mean**2
    rho = UTILIZATION
    prefill = rho + rho**2 * (1 + cs2) / (2 * (1 - rho))
    mean_in, mean_out = mean_lengths(trace)
    fits = min(cost.max_num_seqs, cost.kv_capacity_tokens() / (mean_in + mean_out))
    return {PREFILL: round(prefill, 2), DECODE: round(UTILIZATION * fits, 1)}


def make_autoscaler(kind: str, cfg: SimConfig, trace: Trace, max_replicas: int,
                    static: tuple[int, int] | None = None) -> Autoscaler:
    lo = {PREFILL: 1, DECODE: 1}
    hi = {PREFILL: max_replicas, DECODE: max_replicas}
    if kind == "cleave":
        return ElasticCleave(cleave_config(cfg, trace, max_replicas))
    if kind == "cleave-fixed":  # the same policy without flips or the floor
        return CleaveAutoscaler(cleave_config(cfg, trace, max_replicas))
    if kind == "llmd":
        return LlmdSloFormula(cfg.ttft_slo, cfg.tpot_slo, lo, hi)
    if kind == "hpa":
        return HpaConcurrency(hpa_targets(cfg, trace), lo, hi)
    if kind == "static":
        p, d = static or capacity_estimate(cfg, trace, UTILIZATION)
        return StaticAutoscaler({PREFILL: p, DECODE: d})
    raise ValueError(f"unknown policy {kind!r}: use one of {', '.join(POLICIES)}")


def capacity_estimate(cfg: SimConfig, trace: Trace, utilization: float,
                      rate: float | None = None,
                      lengths: tuple[float, float] | None = None) -> tuple[int, int]:
    """Replicas per role the capacity model asks for at ``rate`` (the trace's peak minute);
    ``lengths``: the trace's mean prompt and output lengths, when already known."""
    cost = cfg.cost
    peak = trace.peak_rate(60.0) if rate is None else rate
    mean_in, mean_out = lengths or mean_lengths(trace)
    pre = peak * mean_in / (cost.prefill_tokens_per_second() * utilization)
    dec = peak * mean_out / (cost.decode_tokens_per_second(mean_in + mean_out / 2) * utilization)
    return max(1, math.ceil(pre)), max(1, math.ceil(dec))


def run_policy(kind: str, trace: Trace, cfg: SimConfig, max_replicas: int,
               static: tuple[int, int] | None = None,
               progress: Callable[[float, float], None] | None = None) -> SimResult:
    if kind == "static":
        static = static or capacity_estimate(cfg, trace, UTILIZATION)
        cfg = replace(cfg, initial=static)
    else:
        cfg = replace(cfg, initial=warm_start(cfg, trace))
    return simulate(trace, cfg, make_autoscaler(kind, cfg, trace, max_replicas, static), progress)


def run_oracle(cfg: SimConfig, trace: Trace, utilization: float,
               window_s: float = 60.0) -> SimResult:
    """The trace under :func:`oracle_schedule`, starting with the replicas it asks first."""
    oracle = oracle_schedule(cfg, trace, utilization, window_s)
    start = oracle.replicas[0]
    return simulate(trace, replace(cfg, initial=(start[PREFILL], start[DECODE])), oracle)


def warm_start(cfg: SimConfig, trace: Trace) -> tuple[int, int]:
    """Autoscaled deployments start warm, sized for the first minute's load as if they had
    been running: the trace measures how they follow load, not a cold cluster's start."""
    first = sum(r.arrival < 60.0 for r in trace.requests) / 60.0
    return capacity_estimate(cfg, trace, UTILIZATION, first)


def size_static(trace: Trace, cfg: SimConfig, max_replicas: int, goal: float = 0.99,
                log: Callable[[str], None] | None = None) -> tuple[tuple[int, int], SimResult]:
    """The smallest fixed deployment that meets the SLO goal on this trace: peak provisioning
    done right. Starts from a lower bound (:func:`static_lower_bound`) and adds a replica to
    whichever role's SLO misses more, until the goal is met."""
    p, d = static_lower_bound(cfg, trace)
    while True:
        res = run_policy("static", trace, cfg, max_replicas, (p, d))
        if log:
            log(f"static {p} prefill + {d} decode: attainment {res.slo_attainment():.4f}")
        if res.slo_attainment() >= goal or (p >= max_replicas and d >= max_replicas):
            return (p, d), res
        if ((res.ttft_attainment() <= res.tpot_attainment() and p < max_replicas)
                or d >= max_replicas):
            p += 1
        else:
            d += 1


def static_lower_bound(cfg: SimConfig, trace: Trace) -> tuple[int, int]:
    """Replicas per role below which no fixed deployment serves the trace's peak minute: the
    capacity model at 100 % utilization, the prefill replicas' share net of what the decode
    replicas lend (with the convertible router a static deployment absorbs its bursts there,
    so sizing prefill alone for the peak would miss cheaper deployments that meet the goal)."""
    mean_in, mean_out = mean_lengths(trace)
    peak = trace.peak_rate(60.0)
    p, d = capacity_estimate(cfg, trace, 1.0, peak, (mean_in, mean_out))
    lending = convertible_prefill(cfg)
    if lending is None:
        return p, d
    lent = lending.lent(d, peak * mean_out)
    net = (peak * mean_in - lent) / cfg.cost.prefill_tokens_per_second()
    return max(1, min(p, math.ceil(net))), d


def oracle_schedule(cfg: SimConfig, trace: Trace, utilization: float,
                    window_s: float = 60.0) -> ElasticOracle:
    """Replicas that know the trace: at each moment, what the capacity model asks for the
    busiest window from now until a replica started now would be ready, so that capacity is
    always up before the load arrives and goes as soon as it has passed."""
    bins = max(1, math.ceil(trace.duration / window_s))
    counts = [0] * bins
    for r in trace.requests:
        counts[min(int(r.arrival // window_s), bins - 1)] += 1
    lengths = mean_lengths(trace)  # once, not per window
    need = [capacity_estimate(cfg, trace, utilization, c / window_s, lengths) for c in counts]
    ahead = math.ceil((cfg.cold_start_s + cfg.interval_s) / window_s)
    cost = cfg.cost
    mean_in, mean_out = lengths
    pre_tput = cost.prefill_tokens_per_second()
    dec_tput = cost.decode_tokens_per_second(mean_in + mean_out / 2)
    lending = convertible_prefill(cfg)
    times, replicas, floor = [], [], []
    for i in range(bins):
        coming = need[i:i + ahead + 1]
        times.append(i * window_s)
        rate = counts[i] / window_s
        peak = max(counts[i:i + ahead + 1]) / window_s
        # As Cleave's policy: the window now at the target utilization, the rise coming
        # before a replica started now is ready met by the decode workers' lent capacity first
        # (what they lend beside their batches at the risen load).
        lent = lending.lent(need[i][1], peak * mean_out) if lending else 0.0
        pre = max(need[i][0], math.ceil(prefill_replicas(rate * mean_in, utilization,
                                                         peak * mean_in / utilization,
                                                         pre_tput, lent)))
        replicas.append({PREFILL: pre, DECODE: max(d for _, d in coming)})
        # The same floor as Cleave's (elastic.ElasticCleave), on the load it knows is coming.
        floor.append(one_worker_fits(peak * mean_in, pre_tput, peak * mean_out, dec_tput,
                                     FLOOR_UTILIZATION))
    return ElasticOracle(times, replicas, floor)
