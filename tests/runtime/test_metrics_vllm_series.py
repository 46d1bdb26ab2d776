"""Every vllm:* series a vLLM dashboard or llm-d's endpoint picker reads, scraped from a real
stack (redis-server, prefill and decode worker processes, the router) after real requests
through the official ``openai`` client: each exported with vLLM's type and labels, each one
that requests feed moved by them, phases counted once per request over the whole fleet, and
the engine's local prefix cache counted when the same prompt comes back."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_stack import SERVED, Stack, start_stack

from cleave.common import metric_names as names

LONG = "the quick brown fox jumps over the lazy dog " * 8  # disaggregated: several KV blocks
SHORT = "hello there"  # served whole by the decode worker
MODEL = {"model_name": SERVED, "engine": "0"}


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # the exposition's TYPE
    moves: bool = True  # whether the test's requests must change it


# vLLM's production-metrics docs (docs/design/metrics.md, usage/metrics.md) and the series its
# Grafana dashboard (examples/observability/prometheus_grafana) and llm-d's picker query.
VLLM_SERIES = (
    Series(names.VLLM_TTFT, "histogram"), Series(names.VLLM_E2E, "histogram"),
    Series(names.VLLM_ITL, "histogram"),
    Series(names.VLLM_RUNNING, "gauge", moves=False), Series(names.VLLM_WAITING, "gauge", False),
    Series(names.VLLM_KV_USAGE, "gauge", moves=False),
    Series(names.VLLM_PROMPT_TOKENS, "counter"), Series(names.VLLM_GENERATION_TOKENS, "counter"),
    Series(names.VLLM_REQUEST_SUCCESS, "counter"),
    Series(names.VLLM_QUEUE_TIME, "histogram"), Series(names.VLLM_PREFILL_TIME, "histogram"),
    Series(names.VLLM_DECODE_TIME, "histogram"), Series(names.VLLM_INFERENCE_TIME, "histogram"),
    Series(names.VLLM_REQUEST_PROMPT_TOKENS, "histogram"),
    Series(names.VLLM_REQUEST_GENERATION_TOKENS, "histogram"),
    Series(names.VLLM_MAX_GENERATION_TOKENS, "histogram"),
    Series(names.VLLM_PARAMS_MAX_TOKENS, "histogram"),
    Series(names.VLLM_ITERATION_TOKENS, "histogram"),
    Series(names.VLLM_PREEMPTIONS, "counter", moves=False),  # needs a full KV pool
    Series(names.VLLM_PREFIX_QUERIES, "counter"),
    Series(names.VLLM_PREFIX_HITS, "counter", moves=False),  # moved by a repeated prompt, below
)


@dataclass
class Fleet:
    """One scrape of every process: family name -> (type, samples of all processes)."""

    kinds: dict[str, set[str]] = field(default_factory=dict)
    samples: dict[str, list[tuple[str, dict[str, str], float]]] = field(default_factory=dict)

    def total(self, sample: str, **labels: str) -> float:
        """The sum of a sample over every process (and every other label)."""
        return sum(v for fam in self.samples.values() for n, ls, v in fam
                   if n == sample and labels.items() <= ls.items())


def _scrape(stack: Stack) -> Fleet:
    assert stack.router is not None
    fleet = Fleet()
    for url in [stack.router.url, *(w.url for w in stack.workers)]:
        text = urllib.request.urlopen(url + "/metrics").read().decode()
        for family in text_string_to_metric_families(text):
            fleet.kinds.setdefault(family.name, set()).add(family.type)
            fleet.samples.setdefault(family.name, []).extend(
                (s.name, s.labels, s.value) for s in family.samples)
    return fleet


def _complete(stack: Stack, prompt: str, max_tokens: int = 4) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                           timeout=60)
    client.completions.create(model=SERVED, prompt=prompt, max_tokens=max_tokens,
                              temperature=0)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("vllm-series-logs"))
    for prompt in (LONG, SHORT):
        _complete(s, prompt)
    yield s
    s.stop()


def _count(fleet: Fleet, name: str, kind: str) -> float:
    sample = {"histogram": name + "_count", "counter": names.total(name)}.get(kind, name)
    return fleet.total(sample, **MODEL)


def test_every_vllm_series_is_exported_with_its_type_and_labels_and_moves(stack: Stack) -> None:
    fleet = _scrape(stack)
    for series in VLLM_SERIES:
        family = series.name.removesuffix("_total") if series.kind == "counter" else series.name
        assert fleet.kinds.get(family) == {series.kind}, (series, fleet.kinds.get(family))
        for sample, labels, _ in fleet.samples[family]:
            if not sample.endswith("_created"):
                rest = set(labels) - {"le", "finished_reason"}
                assert rest == set(MODEL) and labels.items() >= MODEL.items(), (sample, labels)
        if series.moves:
            assert _count(fleet, series.name, series.kind) > 0, series
    info = fleet.samples[names.VLLM_CACHE_CONFIG]
    assert [(ls["engine"], ls["enable_prefix_caching"], v) for _, ls, v in info] \
        == [("0", "True", 1.0)] * len(stack.workers)  # one per worker, none on the router
    assert all(int(ls["num_gpu_blocks"]) > 0 and ls["block_size"] for _, ls, _ in info)


def test_each_phase_of_a_request_is_counted_once_over_the_fleet(stack: Stack) -> None:
    fleet = _scrape(stack)
    finished = fleet.total(names.total(names.VLLM_REQUEST_SUCCESS), **MODEL)
    assert finished == 2
    for per_request in (names.VLLM_PREFILL_TIME, names.VLLM_DECODE_TIME,
                        names.VLLM_REQUEST_PROMPT_TOKENS, names.VLLM_REQUEST_GENERATION_TOKENS,
                        names.VLLM_PARAMS_MAX_TOKENS, names.VLLM_E2E, names.VLLM_TTFT):
        assert fleet.total(per_request + "_count", **MODEL) == finished, per_request
    # Queue and inference time are per engine visit: the disaggregated request visits two.
    for per_visit in (names.VLLM_QUEUE_TIME, names.VLLM_INFERENCE_TIME):
        assert fleet.total(per_visit + "_count", **MODEL) == finished + 1, per_visit
    assert fleet.total(names.QUEUE_TIME + "_count") == finished + 1  # Cleave's, by role
    # max_tokens was 4 for both: the +Inf bucket and the one for 5 hold them, 2 does not.
    params = names.bucket(names.VLLM_PARAMS_MAX_TOKENS)
    assert fleet.total(params, le="5.0", **MODEL) == 2
    assert fleet.total(params, le="2.0", **MODEL) == 0
    assert fleet.total(names.VLLM_PARAMS_MAX_TOKENS + "_sum", **MODEL) == 8


def test_vllms_token_buckets_stop_at_the_models_context(stack: Stack) -> None:
    fleet = _scrape(stack)
    bounds = {ls["le"] for n, ls, _ in fleet.samples[names.VLLM_REQUEST_PROMPT_TOKENS]
              if n.endswith("_bucket")}
    stats = json.loads(urllib.request.urlopen(stack.workers[0].url + "/internal/stats").read())
    max_model_len = stats["max_model_len"]
    assert sorted(float(b) for b in bounds) == \
        [*names.vllm_token_buckets(max_model_len), float("inf")]


def test_the_same_prompt_again_hits_the_engines_prefix_cache(stack: Stack) -> None:
    before = _scrape(stack)
    hits, queries = names.total(names.VLLM_PREFIX_HITS), names.total(names.VLLM_PREFIX_QUERIES)
    _complete(stack, LONG)
    after = _scrape(stack)
    # The KV the first LONG request left in the worker's pool serves it again: whole blocks.
    block = int(after.samples[names.VLLM_CACHE_CONFIG][0][1]["block_size"])
    gained = after.total(hits, **MODEL) - before.total(hits, **MODEL)
    assert gained >= block and gained % block == 0
    assert after.total(queries, **MODEL) - before.total(queries, **MODEL) >= len(LONG.split())
    assert after.total(hits, **MODEL) <= after.total(queries, **MODEL)
