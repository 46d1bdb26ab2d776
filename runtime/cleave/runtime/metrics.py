"""Prometheus metrics of the data plane (names in :mod:`cleave.common.metric_names`, per
docs/metrics.md).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``cleave_time_to_first_token_
seconds``) so existing dashboards and habits carry over. Every metric carries the ``role`` of
the process that records it (prefill, decode, both, router).

vLLM's own series (``vllm:*``, labelled with the served model name) are fed by the same calls:
the request-level ones are :class:`Twin` objects, whose ``labels(role, ...)`` gives a child that
records into both, so the two cannot drift. Each twin mirrors the roles whose observation is
what vLLM's series means, and only those, so that summing over every scraped process counts a
request once: TTFT and e2e as the router sees them (a worker's clock starts late, see
docs/metrics.md), tokens, successes and inter-token latency from the workers, the engine
gauges from the workers and the requests a router holds waiting for a worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from aiohttp import web
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from cleave.common import metric_names as names
from cleave.common.metric_names import LATENCY_BUCKETS, TPOT_BUCKETS

M = TypeVar("M", bound=MetricWrapperBase)
WORKER_ROLES = frozenset({"prefill", "decode", "both"})
ROUTER = frozenset({"router"})
ENGINE = "0"  # vLLM labels each engine of a server; a Cleave worker is one engine
_served = {"model_name": ""}


def serve_as(model_name: str) -> None:
    """The served model name: the ``model_name`` label of this process's vllm:* series."""
    _served["model_name"] = model_name


def served_model_name() -> str:
    return _served["model_name"]


class _TwinChild(Generic[M]):
    def __init__(self, ours: M, theirs: M | None) -> None:
        self._both = (ours,) if theirs is None else (ours, theirs)

    def observe(self, value: float) -> None:
        for m in self._both:
            m.observe(value)  # type: ignore[attr-defined]

    def inc(self, amount: float = 1) -> None:
        for m in self._both:
            m.inc(amount)  # type: ignore[attr-defined]

    def set_function(self, read: Callable[[], float]) -> None:
        for m in self._both:
            m.set_function(read)  # type: ignore[attr-defined]


class Twin(Generic[M]):
    """A Cleave metric (labels ``role``, ...) and vLLM's (``model_name``, ``engine``, ...):
    one call records both; vLLM's only for the roles in ``mirrored``."""

    def __init__(self, ours: M, theirs: M | None, mirrored: frozenset[str]) -> None:
        # ``theirs`` is None until known where vLLM's buckets depend on the model (bind_engine)
        self.ours, self.theirs, self.mirrored = ours, theirs, mirrored

    def labels(self, role: str, *rest: str) -> _TwinChild[M]:
        theirs = (self.theirs.labels(_served["model_name"], ENGINE, *rest)
                  if role in self.mirrored and self.theirs is not None else None)
        return _TwinChild(self.ours.labels(role, *rest), theirs)

    def remove(self, role: str, *rest: str) -> None:
        """Drops Cleave's child only: vLLM's has no role (a flip rebinds it at once)."""
        self.ours.remove(role, *rest)


def _vllm(kind: Callable[..., M], name: str, doc: str, *extra: str, **kw: object) -> M:
    return kind(name, doc, ["model_name", "engine", *extra], **kw)


TTFT = Twin(Histogram(names.TTFT, "Time to first token", ["role"], buckets=LATENCY_BUCKETS),
            _vllm(Histogram, names.VLLM_TTFT, "Histogram of time to first token in seconds.",
                  buckets=names.VLLM_TTFT_BUCKETS), ROUTER)
TPOT = Twin(Histogram(names.TPOT, "Time per output token after the first", ["role"],
                      buckets=TPOT_BUCKETS),
            _vllm(Histogram, names.VLLM_ITL, "Histogram of inter-token latency in seconds.",
                  buckets=names.VLLM_ITL_BUCKETS), WORKER_ROLES)
E2E = Twin(Histogram(names.E2E, "End-to-end request latency", ["role"], buckets=LATENCY_BUCKETS),
           _vllm(Histogram, names.VLLM_E2E, "Histogram of e2e request latency in seconds.",
                 buckets=names.VLLM_E2E_BUCKETS), ROUTER)
RUNNING = Twin(Gauge(names.RUNNING, "Requests in the engine's running batch", ["role"]),
               _vllm(Gauge, names.VLLM_RUNNING, "Number of requests in model execution "
                     "batches."), WORKER_ROLES)
WAITING = Twin(Gauge(names.WAITING, "Requests queued for the engine", ["role"]),
               _vllm(Gauge, names.VLLM_WAITING, "Number of requests waiting to be processed."),
               WORKER_ROLES | ROUTER)
KV_USAGE = Twin(Gauge(names.KV_USAGE,
                      "Share of the KV block pool in use: the HBM-pressure signal", ["role"]),
                _vllm(Gauge, names.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage."),
                WORKER_ROLES)
PROMPT_TOKENS = Twin(Counter(names.PROMPT_TOKENS, "Prompt tokens processed", ["role"]),
                     _vllm(Counter, names.VLLM_PROMPT_TOKENS, "Number of prefill tokens "
                           "processed."), WORKER_ROLES)
GENERATION_TOKENS = Twin(Counter(names.GENERATION_TOKENS, "Tokens generated", ["role"]),
                         _vllm(Counter, names.VLLM_GENERATION_TOKENS, "Number of generation "
                               "tokens processed."), WORKER_ROLES)
REQUESTS = Twin(Counter(names.REQUESTS, "Finished requests by outcome",
                        ["role", "finish_reason"]),
                _vllm(Counter, names.VLLM_REQUEST_SUCCESS, "Count of successfully processed "
                      "requests.", "finished_reason"), WORKER_ROLES)
ROUTER_REQUESTS = Counter(names.ROUTER_REQUESTS, "API requests the router answered",
                          ["endpoint", "code"])
ROUTER_ERRORS = Counter(names.ROUTER_ERRORS, "Errors the router sent, as the response's status "
                        "or in-band in a stream already started", ["code"])
ROUTER_IN_FLIGHT = Gauge(names.ROUTER_IN_FLIGHT,
                         "Generation requests the router is serving now")
KV_TRANSFER_BYTES = Counter(names.KV_TRANSFER_BYTES,
                            "KV bytes moved through the block store", ["role", "direction"])
KV_TRANSFER_SECONDS = Histogram(names.KV_TRANSFER_SECONDS,
                                "Time to save or load a request's KV blocks",
                                ["role", "direction"], buckets=LATENCY_BUCKETS)
KV_TRANSFER_FAILURES = Counter(names.KV_TRANSFER_FAILURES,
                               "KV saves or loads that failed (the request recomputed)",
                               ["role", "direction"])
KV_RECOMPUTE_FALLBACKS = Counter(
    names.KV_RECOMPUTE_FALLBACKS,
    "Decode requests that recomputed prompt blocks the store should have held "
    "(missing, evicted, corrupt, or the store unavailable)")
KV_LOADED_BLOCKS = Counter(names.KV_LOADED_BLOCKS,
                           "KV blocks loaded from the store instead of computed", ["purpose"])
ROUTING_DECISIONS = Counter(names.ROUTING_DECISIONS,
                            "Router choices by path and reason", ["path", "reason"])


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The router's outermost middleware: the status every API request ended with (errors
    already turned into responses inside). The route's pattern, not the path, is the label:
    a client cannot mint series."""
    status = 500  # what aiohttp answers for an exception no middleware turned into a response
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        if request.path.startswith("/v1/") or request.path in ("/tokenize", "/detokenize"):
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "unmatched"
            ROUTER_REQUESTS.labels(endpoint, str(status)).inc()
            if status >= 400:
                ROUTER_ERRORS.labels(str(status)).inc()


async def metrics_endpoint(_: web.Request) -> web.Response:
    """``GET /metrics`` for every process of the data plane (router and workers)."""
    return web.Response(body=generate_latest(REGISTRY),
                        headers={"Content-Type": "text/plain; version=0.0.4"})
