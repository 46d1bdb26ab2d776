"""llm-d's published SLO-aware autoscaling episode, re-run in the simulator.

The setup of ``guides/workload-autoscaling/slo-aware/benchmark-templates/`` in llm-d/llm-d:
Qwen3-32B (``--model`` a config.json; ``bench/models/Qwen3-32B``) on H100 at TP=2, vLLM-style
aggregated serving (every replica runs both phases, chunked prefill within 8192 tokens per
step), bounds 3-8, pod ready ~100 s after scheduling, TTFT <= 3 s and TPOT <= 100 ms at p90,
the staged ramp (:func:`cleave.autoscaling.traces.llmd_ramp`), the EPP scraped at 5 s and the
recording rules evaluated at 15 s (a signal on average ~10 s old); the law reads the gateway's
per-request histograms with the EPP's buckets (:mod:`cleave.autoscaling.llmd`). Scored as
llm-d scores it: ``SimResult.llmd_attainment`` (1 - (TTFT + TPOT violations) / requests), and
the time-averaged replicas over the episode, which runs until the pool has drained back to its
floor after the load ends.
Published: 95.8 % at 5.93 replicas; a static pool of 8: 100 %.
"""

from __future__ import annotations

from dataclasses import replace

from cleave.autoscaling.baselines import Autoscaler, StaticAutoscaler
from cleave.autoscaling.costmodel import GPUS, CostModel, build_cost_model
from cleave.autoscaling.elastic import ElasticCleave
from cleave.autoscaling.llmd import LlmdSloFormula
from cleave.autoscaling.policy import DECODE
from cleave.autoscaling.scenarios import cleave_config, warm_start
from cleave.autoscaling.simresult import SimConfig, SimResult
from cleave.autoscaling.simulator import simulate
from cleave.autoscaling.simworker import EngineConfig
from cleave.autoscaling.traces import Trace, llmd_ramp

PUBLISHED_ATTAINMENT = 0.958
PUBLISHED_AVG_REPLICAS = 5.93
MIN_REPLICAS, MAX_REPLICAS = 3, 8
TAIL_S = 900.0  # simulated after the load ends, for the drain back to the floor
RAMP_POLICIES = ("llmd", "static", "cleave")
# H100 achieved fractions for this experiment, calibrated on one figure of the same guide that
# is not the one replicated: "the system settles ... ~1.4-1.5 rps per H100 TP=2 replica for a
# 4000-token-prefill workload at these SLOs". At the datasheet defaults (0.45 of peak FLOP/s,
# 0.70 of HBM bandwidth) a static pool of 8 meets only 80 % of the ramp, against llm-d's 100 %;
# at 0.60 / 0.80 (vLLM on Hopper: prefill MFU of 55-65 %, decode at 75-85 % of HBM bandwidth)
# the simulated knee of one replica falls between 1.4 and 1.5 req/s, as reported.
LLMD_H100 = replace(GPUS["H100"], compute_efficiency=0.60, bandwidth_efficiency=0.80)


def ramp_cost(model: str) -> CostModel:
    """The experiment's cost model: ``model`` (a config.json) on calibrated H100s, TP=2."""
    return build_cost_model(LLMD_H100, model, 2, 2)


def ramp_config(cost: CostModel, cold_start_s: float = 100.0) -> SimConfig:
    # No slow first steps after ready: the guide's warm-up T_w ends at ready ("model load +
    # torch-compile", with the compile cache on a hostPath volume), and vLLM captures its CUDA
    # graphs before it reports ready, so the pod serves at full speed from then on. KV as
    # vLLM's scheduler takes it: the prompt's, a token a step, the newest preempted when full.
    return SimConfig(cost, ttft_slo=3.0, tpot_slo=0.1, cold_start_s=cold_start_s,
                     interval_s=15.0, scrape_lag_s=10.0, aggregated=True,
                     initial=(0, MIN_REPLICAS),
                     engine=EngineConfig(both_budget=8192, warmup_s=0.0, reserve_output=False))


def _with_tail(trace: Trace) -> Trace:
    return replace(trace, duration=trace.duration + TAIL_S)


def ramp_autoscaler(policy: str, cfg: SimConfig, trace: Trace) -> tuple[SimConfig, Autoscaler]:
    """The simulation config and autoscaler of one policy on the ramp. Cleave runs as Cleave
    deploys (disaggregated, convertible router, flips and the floor) within the same bound of 8
    replicas in all (at least 1 per role), with no 3-replica floor of its own."""
    if policy == "llmd":
        return cfg, LlmdSloFormula(cfg.ttft_slo, cfg.tpot_slo, {DECODE: MIN_REPLICAS},
                                   {DECODE: MAX_REPLICAS})
    if policy == "static":
        return replace(cfg, initial=(0, MAX_REPLICAS)), StaticAutoscaler({DECODE: MAX_REPLICAS})
    if policy == "cleave":
        dis = replace(cfg, aggregated=False)
        dis = replace(dis, initial=warm_start(dis, trace))
        base = cleave_config(dis, trace, MAX_REPLICAS - 1)
        roles = {r: replace(p, max_replicas=MAX_REPLICAS - 1) for r, p in base.roles.items()}
        gpu = dis.cost.prefill_tp
        budget = MAX_REPLICAS * gpu
        roles = {r: replace(p, gpus_per_replica=gpu) for r, p in roles.items()}
        return dis, ElasticCleave(replace(base, roles=roles, gpu_budget=budget))
    raise ValueError(f"unknown ramp policy {policy!r}: use one of {', '.join(RAMP_POLICIES)}")


def episode_replicas(result: SimResult, load_end: float) -> float:
    """Time-averaged replicas (pods holding GPUs) from the start until the pool is back at its
    lowest count after the load ends, as llm-d's avg_over_time(kube_deployment_status_replicas)
    over its episode window."""
    tp = result.config.cost.decode_tp
    samples = result.samples
    after = [s for s in samples if s.t >= load_end]
    if not after:
        return result.avg_replicas()
    floor = min(s.gpus for s in after)
    end = next(s.t for s in after if s.gpus == floor)
    window = [s.gpus / tp for s in samples if s.t <= end]
    return sum(window) / len(window)


def run_ramp(policy: str, cost: CostModel, seed: int = 0, cold_start_s: float = 100.0,
             flip_s: float | None = None,
             redispatch: bool = False) -> tuple[SimResult, float]:
    """(result, episode average replicas) of one policy on one seed of the ramp;
    ``redispatch``: Cleave's router re-dispatches queued prompts (SimConfig.redispatch)."""
    trace = llmd_ramp(seed)
    cfg = ramp_config(cost, cold_start_s)
    if flip_s is not None:
        cfg = replace(cfg, flip_s=flip_s)
    cfg, autoscaler = ramp_autoscaler(policy, cfg, trace)
    if policy == "cleave":  # llm-d's gateway and the static pool route each request once
        cfg = replace(cfg, redispatch=redispatch)
    result = simulate(_with_tail(trace), cfg, autoscaler)
    return result, episode_replicas(result, trace.duration)


__all__ = ["PUBLISHED_ATTAINMENT", "PUBLISHED_AVG_REPLICAS", "RAMP_POLICIES",
           "episode_replicas", "ramp_config", "run_ramp"]
