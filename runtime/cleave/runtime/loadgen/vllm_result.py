"""The figures under the names ``vllm bench serve`` gives them in its JSON result, so that a
run of ``cleave bench`` and one of vLLM's compare key by key (and tools that read vLLM's
result files read ``report.json``, where these keys sit at the top level).

Definitions agree with vLLM's: ``duration`` from the first send to the last end, throughputs
over it, TTFT to the first token, TPOT ``(e2e - ttft) / (output tokens - 1)``, ITL every gap
between chunks, ``e2el`` the end-to-end latency, ``std`` the population standard deviation,
``median`` the 50th percentile; a metric with no value is 0, as vLLM writes it. Percentiles
are 50, 90, 95 and 99 (vLLM writes the ones ``--metric-percentiles`` names, 99 by default).
"""

from __future__ import annotations

from typing import Any

from cleave.runtime.loadgen.report import PERCENTILES

# Ours -> vLLM's name for the same latency.
_METRICS = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el"))


def max_in_flight(per_request: list[dict[str, Any]]) -> int:
    """The most requests that were in flight at once (vLLM's ``max_concurrent_requests``)."""
    events: list[tuple[float, int]] = []
    for r in per_request:
        if r["error"] == "cancelled" or r["e2e_ms"] is None:
            continue
        events.append((r["start_s"], 1))
        events.append((r["start_s"] + r["e2e_ms"] / 1000.0, -1))
    peak = now = 0
    for _, step in sorted(events):  # an end sorts before a start at the same instant
        now += step
        peak = max(peak, now)
    return peak


def latency_keys(latency_ms: dict[str, dict[str, float] | None]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ours, theirs in _METRICS:
        dist = latency_ms[ours] or {}
        out[f"mean_{theirs}_ms"] = dist.get("mean", 0.0)
        out[f"median_{theirs}_ms"] = dist.get("p50", 0.0)
        out[f"std_{theirs}_ms"] = dist.get("std", 0.0)
        for q in PERCENTILES:
            out[f"p{q}_{theirs}_ms"] = dist.get(f"p{q}", 0.0)
    return out


def vllm_result(report: dict[str, Any]) -> dict[str, Any]:
    """vLLM's result keys, from a report ``build_report`` made (config as ``cleave bench``
    writes it)."""
    cfg, req, thr, tok = report["config"], report["requests"], report["throughput"], \
        report["tokens"]
    good = report["goodput"]
    backend = "openai-chat" if cfg.get("endpoint") == "chat" else "openai"
    return {
        "date": cfg.get("started_at"),
        "backend": backend,
        "endpoint_type": backend,
        "model_id": cfg.get("model"),
        "num_prompts": req["sent"],
        "request_rate": cfg["rate"] if cfg.get("rate") is not None else "inf",
        "burstiness": cfg.get("gamma_shape") or 1.0,
        "max_concurrency": cfg.get("concurrency"),
        "duration": report["duration_s"],
        "completed": req["completed"],
        "failed": req["failed"],
        "total_input_tokens": tok["prompt"],
        "total_output_tokens": tok["output"],
        "request_throughput": thr["requests_per_s"],
        "request_goodput": good["requests_per_s"] if good else None,
        "output_throughput": thr["output_tokens_per_s"],
        "total_token_throughput": thr["total_tokens_per_s"],
        "max_concurrent_requests": max_in_flight(report["per_request"]),
        **latency_keys(report["latency_ms"]),
    }
