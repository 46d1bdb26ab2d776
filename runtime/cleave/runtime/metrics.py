"""Prometheus metrics of the data plane (names per docs/metrics.md, ``cleave_`` prefix).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``cleave_time_to_first_token_
seconds``) so existing dashboards and habits carry over. Every metric carries the ``role`` of
the process that records it (prefill, decode, both, router).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)

TTFT = Histogram("cleave_time_to_first_token_seconds", "Time to first token", ["role"],
                 buckets=_LATENCY_BUCKETS)
TPOT = Histogram("cleave_time_per_output_token_seconds",
                 "Time per output token after the first", ["role"], buckets=_TPOT_BUCKETS)
E2E = Histogram("cleave_e2e_request_latency_seconds", "End-to-end request latency", ["role"],
                buckets=_LATENCY_BUCKETS)
RUNNING = Gauge("cleave_num_requests_running", "Requests in the engine's running batch",
                ["role"])
WAITING = Gauge("cleave_num_requests_waiting", "Requests queued for the engine", ["role"])
KV_USAGE = Gauge("cleave_kv_cache_usage_ratio",
                 "Share of the KV block pool in use: the HBM-pressure signal", ["role"])
PROMPT_TOKENS = Counter("cleave_prompt_tokens", "Prompt tokens processed", ["role"])
GENERATION_TOKENS = Counter("cleave_generation_tokens", "Tokens generated", ["role"])
REQUESTS = Counter("cleave_requests", "Finished requests by outcome", ["role", "finish_reason"])
KV_TRANSFER_BYTES = Counter("cleave_kv_transfer_bytes",
                            "KV bytes moved through the block store", ["role", "direction"])
KV_TRANSFER_SECONDS = Histogram("cleave_kv_transfer_seconds",
                                "Time to save or load a request's KV blocks",
                                ["role", "direction"], buckets=_LATENCY_BUCKETS)
KV_TRANSFER_FAILURES = Counter("cleave_kv_transfer_failures",
                               "KV saves or loads that failed (the request recomputed)",
                               ["role", "direction"])
KV_RECOMPUTE_FALLBACKS = Counter(
    "cleave_kv_recompute_fallbacks",
    "Decode requests that recomputed prompt blocks the store should have held "
    "(missing, evicted, corrupt, or the store unavailable)")
KV_LOADED_BLOCKS = Counter("cleave_kv_loaded_blocks",
                           "KV blocks loaded from the store instead of computed", ["purpose"])
ROUTING_DECISIONS = Counter("cleave_routing_decisions",
                            "Router choices by path and reason", ["path", "reason"])


async def metrics_endpoint(_: web.Request) -> web.Response:
    """``GET /metrics`` for every process of the data plane (router and workers)."""
    return web.Response(body=generate_latest(REGISTRY),
                        headers={"Content-Type": "text/plain; version=0.0.4"})
