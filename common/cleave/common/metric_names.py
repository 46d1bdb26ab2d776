"""The one definition of every Prometheus metric name and bucket set Cleave exports.

The runtime and the block store register their metrics under these names; the autoscaler's
signals, its Prometheus queries, the simulator's replicas, the dashboards' tests and every
test fake read them from here. A rename is then one edit, and a metric the autoscaler looks
for cannot silently stop existing (``tests/common/test_metric_names.py`` refuses a metric
name typed anywhere else). Plain constants: ``cleave.common`` is in every image.

Counters are named without ``_total``, as ``prometheus_client`` takes them; the exposition
(and PromQL) adds it: use :func:`total`. Docs: docs/metrics.md.
"""

from __future__ import annotations

# -- data plane (cleave.runtime.metrics): every series carries the process's ``role`` -------
TTFT = "cleave_time_to_first_token_seconds"
TPOT = "cleave_time_per_output_token_seconds"
E2E = "cleave_e2e_request_latency_seconds"
RUNNING = "cleave_num_requests_running"
WAITING = "cleave_num_requests_waiting"
KV_USAGE = "cleave_kv_cache_usage_ratio"
PROMPT_TOKENS = "cleave_prompt_tokens"
GENERATION_TOKENS = "cleave_generation_tokens"
REQUESTS = "cleave_requests"
KV_TRANSFER_BYTES = "cleave_kv_transfer_bytes"
KV_TRANSFER_SECONDS = "cleave_kv_transfer_seconds"
KV_TRANSFER_FAILURES = "cleave_kv_transfer_failures"
KV_RECOMPUTE_FALLBACKS = "cleave_kv_recompute_fallbacks"
KV_LOADED_BLOCKS = "cleave_kv_loaded_blocks"
ROUTING_DECISIONS = "cleave_routing_decisions"  # the router's
# The router's own: every API request by endpoint and status, every error it sent (in-band
# stream errors included), and the generation requests it is serving now.
ROUTER_REQUESTS = "cleave_router_requests"
ROUTER_ERRORS = "cleave_router_errors"
ROUTER_IN_FLIGHT = "cleave_router_requests_in_flight"
# Per engine visit (a disaggregated request waits in two engines) and per finished request.
QUEUE_TIME = "cleave_request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "cleave_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "cleave_request_generation_tokens"

# -- vLLM's names for the same observations (issue 16): what llm-d's endpoint picker, KEDA
# ScaledObjects written for vLLM and vLLM's dashboards read. Labels ``model_name`` and
# ``engine`` as vLLM 0.32's; buckets as its own (below). Fed by the cleave_* metric beside each.
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"  # vLLM's successor of time_per_output_token
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction, 0..1, despite the name
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_REQUEST_SUCCESS = "vllm:request_success"
VLLM_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_PREFILL_TIME = "vllm:request_prefill_time_seconds"
VLLM_DECODE_TIME = "vllm:request_decode_time_seconds"
VLLM_INFERENCE_TIME = "vllm:request_inference_time_seconds"
VLLM_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
VLLM_REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
VLLM_MAX_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
VLLM_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
VLLM_ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram: "_total" is in vLLM's name
VLLM_PREEMPTIONS = "vllm:num_preemptions"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries"  # in tokens, as vLLM's
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits"
VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # a gauge set to 1, the facts in its labels

# -- the KV block store (cleave.kv_store.metrics) --------------------------------------------
STORE_HITS = "cleave_kv_store_hits"
STORE_MISSES = "cleave_kv_store_misses"
STORE_WRITTEN_BYTES = "cleave_kv_store_written_bytes"
STORE_READ_BYTES = "cleave_kv_store_read_bytes"
STORE_CORRUPT = "cleave_kv_store_corrupt_blocks"
STORE_EVICTIONS = "cleave_kv_store_evictions_noticed"
STORE_ERRORS = "cleave_kv_store_errors"
STORE_OP_SECONDS = "cleave_kv_store_operation_seconds"

# -- the autoscaler (cleave.autoscaling.metrics) ---------------------------------------------
AUTOSCALER_DESIRED = "cleave_autoscaler_desired_replicas"
AUTOSCALER_DECISIONS = "cleave_autoscaler_decisions"

ALL = (TTFT, TPOT, E2E, RUNNING, WAITING, KV_USAGE, PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS,
       KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS, KV_TRANSFER_FAILURES, KV_RECOMPUTE_FALLBACKS,
       KV_LOADED_BLOCKS, ROUTING_DECISIONS, ROUTER_REQUESTS, ROUTER_ERRORS, ROUTER_IN_FLIGHT,
       VLLM_TTFT, VLLM_ITL, VLLM_E2E, VLLM_RUNNING, VLLM_WAITING, VLLM_KV_USAGE,
       VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS, VLLM_REQUEST_SUCCESS, QUEUE_TIME,
       REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, VLLM_QUEUE_TIME, VLLM_PREFILL_TIME,
       VLLM_DECODE_TIME, VLLM_INFERENCE_TIME, VLLM_REQUEST_PROMPT_TOKENS,
       VLLM_REQUEST_GENERATION_TOKENS, VLLM_MAX_GENERATION_TOKENS, VLLM_PARAMS_MAX_TOKENS,
       VLLM_ITERATION_TOKENS, VLLM_PREEMPTIONS, VLLM_PREFIX_QUERIES, VLLM_PREFIX_HITS,
       VLLM_CACHE_CONFIG, STORE_HITS,
       STORE_MISSES, STORE_WRITTEN_BYTES, STORE_READ_BYTES, STORE_CORRUPT, STORE_EVICTIONS,
       STORE_ERRORS, STORE_OP_SECONDS, AUTOSCALER_DESIRED, AUTOSCALER_DECISIONS)

# -- bucket sets (upper bounds in seconds; Prometheus adds +Inf) ------------------------------
# Request-scale latencies: TTFT, end-to-end, a request's KV transfer.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
# One decode step.
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
# vLLM's own (vllm/v1/metrics/buckets.py, 0.32), so its dashboards' quantiles read alike.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's request-phase histograms (queue, prefill, decode, inference) share its e2e buckets.
VLLM_REQUEST_TIME_BUCKETS = VLLM_E2E_BUCKETS
# Tokens one engine step computed (vLLM's powers of two up to a batch budget).
VLLM_ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                                4096.0, 8192.0, 16384.0)
# Cleave's token-count histograms: a fixed 1-2-5 series (vLLM's stops at the model's context).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


def vllm_token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for a request's token counts: 1, 2, 5, 10, ... up to the context."""
    return tuple(float(m * 10**e) for e in range(len(str(max_model_len)))
                 for m in (1, 2, 5) if m * 10**e <= max_model_len)


# One store round trip.
STORE_OP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0)


def total(counter: str) -> str:
    """A counter's sample name on a ``/metrics`` page and in PromQL."""
    return counter + "_total"


def bucket(histogram: str) -> str:
    """A histogram's bucket series."""
    return histogram + "_bucket"
