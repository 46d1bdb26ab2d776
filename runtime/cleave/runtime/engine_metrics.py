"""A worker's engine-level and per-request metrics beyond the core set of :mod:`metrics`:
vLLM's request-phase and token-count histograms, its engine counters and cache facts, and
Cleave's queue-time and token-count histograms beside them (docs/metrics.md).

The engine stays free of Prometheus: it counts in plain ints (prefix-cache lookups in the
block manager, preemptions in its stats), stamps each request's events on a clock and hands
the intervals over with the request's last output (``RequestOutput.times``), and calls a plain
function with each step's token count. This module turns those into series. Only workers
import it: the router has no engine, and exports none of these.

Which worker records what, so that a sum over every scraped process means what vLLM's does:
per *engine visit* (a disaggregated request visits the prefill worker's engine, then the
decode worker's): queue and inference time; per *phase*, where it ran: prefill time (not on a
decode worker continuing a prefilled request) and decode time (not on the prefill worker);
per *finished request*, where ``vllm:request_success`` counts it: the token-count histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import REGISTRY, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from cleave.common import metric_names as names
from cleave.runtime import metrics
from cleave.runtime.metrics import WORKER_ROLES, Twin, _vllm

if TYPE_CHECKING:
    from cleave.runtime.engine.llm_engine import LLMEngine

class Times(Protocol):
    """What the engine measured of one request (``engine.outputs.RequestTimes``)."""

    @property
    def queue(self) -> float: ...
    @property
    def prefill(self) -> float: ...
    @property
    def decode(self) -> float: ...
    @property
    def inference(self) -> float: ...


class Finished(Protocol):
    """A request's last output (``engine.outputs.RequestOutput``), as far as metrics read it."""

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def finish_reason(self) -> object: ...
    @property
    def times(self) -> Times | None: ...


@dataclass(frozen=True)
class EngineCounts:
    """The engine's cumulative plain-int counters, read at scrape time."""

    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int


def _time(name: str, doc: str) -> Histogram:
    return _vllm(Histogram, name, doc, buckets=names.VLLM_REQUEST_TIME_BUCKETS)


QUEUE_TIME = Twin(Histogram(names.QUEUE_TIME, "Time a request waited for the engine to "
                            "schedule it", ["role"], buckets=names.LATENCY_BUCKETS),
                  _time(names.VLLM_QUEUE_TIME, "Histogram of time spent in WAITING phase "
                        "for request."), WORKER_ROLES)
PREFILL_TIME = _time(names.VLLM_PREFILL_TIME, "Histogram of time spent in PREFILL phase for "
                     "request.")
DECODE_TIME = _time(names.VLLM_DECODE_TIME, "Histogram of time spent in DECODE phase for "
                    "request.")
INFERENCE_TIME = _time(names.VLLM_INFERENCE_TIME, "Histogram of time spent in RUNNING phase "
                       "for request.")
ITERATION_TOKENS = _vllm(Histogram, names.VLLM_ITERATION_TOKENS, "Histogram of number of "
                         "tokens per engine_step.", buckets=names.VLLM_ITERATION_TOKEN_BUCKETS)
# vLLM's token-count buckets stop at the model's context: built by bind_engine.
PROMPT_LENGTH = Twin(Histogram(names.REQUEST_PROMPT_TOKENS, "Prompt tokens of each finished "
                               "request", ["role"], buckets=names.TOKEN_BUCKETS), None,
                     WORKER_ROLES)
GENERATION_LENGTH = Twin(Histogram(names.REQUEST_GENERATION_TOKENS, "Output tokens of each "
                                   "finished request", ["role"], buckets=names.TOKEN_BUCKETS),
                         None, WORKER_ROLES)
_per_model: dict[str, Histogram] = {}  # vLLM's token-count histograms, by name


def _token_histograms(max_model_len: int) -> None:
    """(Re)build vLLM's token-count histograms with its buckets for this context length."""
    buckets = names.vllm_token_buckets(max_model_len)
    docs = {names.VLLM_REQUEST_PROMPT_TOKENS: "Number of prefill tokens processed.",
            names.VLLM_REQUEST_GENERATION_TOKENS: "Number of generation tokens processed.",
            names.VLLM_MAX_GENERATION_TOKENS: "Histogram of maximum number of requested "
                                              "generation tokens.",
            names.VLLM_PARAMS_MAX_TOKENS: "Histogram of the max_tokens request parameter."}
    for name, doc in docs.items():
        old = _per_model.get(name)
        if old is not None:
            if old._upper_bounds[:-1] == list(buckets):  # type: ignore[attr-defined]
                continue
            REGISTRY.unregister(old)  # one engine per process: only tests rebind
        _per_model[name] = _vllm(Histogram, name, doc, buckets=buckets)
    PROMPT_LENGTH.theirs = _per_model[names.VLLM_REQUEST_PROMPT_TOKENS]
    GENERATION_LENGTH.theirs = _per_model[names.VLLM_REQUEST_GENERATION_TOKENS]


class _EngineCounters(Collector):
    """vLLM's engine counters, read from the engine's plain ints at each scrape."""

    def __init__(self) -> None:
        self.read: Callable[[], EngineCounts] | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # nothing until an engine is bound: the router exports none

    def collect(self) -> Iterator[Metric]:
        if self.read is None:
            return
        counts = self.read()
        labels = [metrics.served_model_name(), metrics.ENGINE]
        for name, doc, value in (
                (names.VLLM_PREFIX_QUERIES, "Prefix cache queries, in terms of number of "
                 "queried tokens.", counts.prefix_queried_tokens),
                (names.VLLM_PREFIX_HITS, "Prefix cache hits, in terms of number of cached "
                 "tokens.", counts.prefix_hit_tokens),
                (names.VLLM_PREEMPTIONS, "Cumulative number of preemption from the engine.",
                 counts.preemptions)):
            family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            family.add_metric(labels, value)
            yield family


_COUNTERS = _EngineCounters()
REGISTRY.register(_COUNTERS)
CACHE_CONFIG = Gauge(names.VLLM_CACHE_CONFIG, "Information of the LLMEngine CacheConfig",
                     ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks",
                      "engine"])


def bind_engine(core: LLMEngine) -> None:
    """Export this worker's engine (after ``metrics.serve_as``): its counters, cache facts
    and, through ``core.step_observer``, each step's token count."""
    _token_histograms(core.max_model_len)
    blocks, stats = core.block_manager, core.stats
    _COUNTERS.read = lambda: EngineCounts(blocks.prefix_queried_tokens,
                                          blocks.prefix_hit_tokens, stats.preemptions)
    CACHE_CONFIG.clear()
    CACHE_CONFIG.labels(str(blocks.block_size), str(core.dtype).removeprefix("torch."), "True",
                        str(blocks.num_blocks), metrics.ENGINE).set(1)
    model = (metrics.served_model_name(), metrics.ENGINE)
    assert QUEUE_TIME.theirs is not None
    for histogram in (QUEUE_TIME.theirs, PREFILL_TIME, DECODE_TIME, INFERENCE_TIME,
                      *_per_model.values()):
        histogram.labels(*model)  # exported at zero from the start, as vLLM's are
    core.step_observer = ITERATION_TOKENS.labels(*model).observe


def record_visit(role: str, out: Finished, *, prefilled: bool, prefill_only: bool) -> None:
    """A request left this worker's engine: the phases it ran here. ``prefilled``: its prompt
    was prefilled elsewhere; ``prefill_only``: it stopped at the first token for a decode
    worker to continue."""
    t = out.times
    if t is None:
        return
    model = (metrics.served_model_name(), metrics.ENGINE)
    QUEUE_TIME.labels(role).observe(t.queue)
    INFERENCE_TIME.labels(*model).observe(t.inference)
    if not prefilled:
        PREFILL_TIME.labels(*model).observe(t.prefill)
    if not prefill_only:
        # Continuing a prefilled request is all decode: its first token came with it.
        DECODE_TIME.labels(*model).observe(t.inference if prefilled else t.decode)


def record_finished(role: str, out: Finished, max_tokens: int, *, prefilled: bool) -> None:
    """A request finished on this worker (where ``vllm:request_success`` counts it)."""
    metrics.GENERATION_TOKENS.labels(role).inc(out.num_output_tokens)
    if not prefilled:  # a prefilled request's prompt was counted on the prefill worker
        metrics.PROMPT_TOKENS.labels(role).inc(out.num_prompt_tokens)
    metrics.REQUESTS.labels(role, str(out.finish_reason)).inc()
    record_visit(role, out, prefilled=prefilled, prefill_only=False)
    PROMPT_LENGTH.labels(role).observe(out.num_prompt_tokens)
    GENERATION_LENGTH.labels(role).observe(out.num_output_tokens)
    if _per_model:
        model = (metrics.served_model_name(), metrics.ENGINE)
        # One sequence per request here: its length is the group's longest (n > 1 is the
        # router's fan-out into separate requests).
        _per_model[names.VLLM_MAX_GENERATION_TOKENS].labels(*model).observe(
            out.num_output_tokens)
        _per_model[names.VLLM_PARAMS_MAX_TOKENS].labels(*model).observe(max_tokens)
