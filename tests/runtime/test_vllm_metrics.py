"""vLLM's metric names beside Cleave's (issue 16): what llm-d's endpoint picker, KEDA and
vLLM's dashboards read, scraped from real worker and router processes after real requests, and
the router's own request, error and in-flight counters."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_stack import SERVED, Stack, post_raw, start_stack

from cleave.common import metric_names as names

LONG = "the quick brown fox jumps over the lazy dog " * 8  # disaggregated
SHORT = "hello there"  # served whole by the decode worker
VLLM = {"model_name": SERVED, "engine": "0"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("vllm-metrics-logs"))
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
    for prompt in (LONG, SHORT):
        client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0)
    assert post_raw(s.base_url + "/completions", b'{"model": "nope", "prompt": "x"}')[0] == 404
    yield s
    s.stop()


def _scrape(url: str) -> Samples:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels (KeyError when it is not exported)."""
    return samples[(name, frozenset(labels.items()))]


def _worker(stack: Stack, role: str) -> str:
    return next(w.url for w in stack.workers if w.name.startswith(role))


def test_a_decode_worker_exports_vllm_series_fed_by_cleaves(stack: Stack) -> None:
    got = _scrape(_worker(stack, "decode"))
    for gauge in (names.VLLM_RUNNING, names.VLLM_WAITING):
        assert _value(got, gauge, **VLLM) == 0  # idle now: what llm-d's picker reads
    assert 0 <= _value(got, names.VLLM_KV_USAGE, **VLLM) <= 1  # a fraction, as vLLM's
    # One observation, two series: each vLLM number equals Cleave's for the same role.
    role = {"role": "decode"}
    for theirs, ours in ((names.VLLM_GENERATION_TOKENS, names.GENERATION_TOKENS),
                         (names.VLLM_PROMPT_TOKENS, names.PROMPT_TOKENS)):
        assert _value(got, names.total(theirs), **VLLM) == \
            _value(got, names.total(ours), **role) > 0
    done = [(got.get((names.total(names.VLLM_REQUEST_SUCCESS),
                      frozenset({**VLLM, "finished_reason": r}.items())), 0.0),
             got.get((names.total(names.REQUESTS),
                      frozenset({**role, "finish_reason": r}.items())), 0.0))
            for r in ("stop", "length")]
    assert all(theirs == ours for theirs, ours in done)
    assert sum(theirs for theirs, _ in done) == 2  # both requests, by vLLM's label
    assert _value(got, names.VLLM_ITL + "_count", **VLLM) == \
        _value(got, names.TPOT + "_count", **role) > 0
    # The router's TTFT is vLLM's here: a worker's own would count each request twice.
    assert not any(n.startswith(names.VLLM_TTFT) for n, _ in got)


def test_the_prefill_worker_counts_the_prompt_it_served(stack: Stack) -> None:
    got = _scrape(_worker(stack, "prefill"))
    assert _value(got, names.total(names.VLLM_PROMPT_TOKENS), **VLLM) == \
        _value(got, names.total(names.PROMPT_TOKENS), role="prefill") > 0


def test_the_router_exports_client_latencies_and_its_own_counters(stack: Stack) -> None:
    assert stack.router is not None
    got = _scrape(stack.router.url)
    for theirs, ours in ((names.VLLM_TTFT, names.TTFT), (names.VLLM_E2E, names.E2E)):
        assert _value(got, theirs + "_count", **VLLM) == \
            _value(got, ours + "_count", role="router") == 2
    assert _value(got, theirs + "_bucket", **VLLM, le="7680.0") == 2  # vLLM's buckets
    assert _value(got, names.VLLM_WAITING, **VLLM) == 0  # requests held for a worker
    requests = names.total(names.ROUTER_REQUESTS)
    assert _value(got, requests, endpoint="/v1/completions", code="200") == 2
    assert _value(got, requests, endpoint="/v1/completions", code="404") == 1
    assert _value(got, names.total(names.ROUTER_ERRORS), code="404") == 1
    assert _value(got, names.ROUTER_IN_FLIGHT) == 0
    # Tokens and successes are the workers': the router exporting them too would double them.
    assert not any(n.startswith(names.VLLM_GENERATION_TOKENS) for n, _ in got)


def test_a_role_flip_moves_cleaves_gauge_and_keeps_vllms() -> None:
    from prometheus_client import REGISTRY

    from cleave.runtime import metrics
    from cleave.runtime.serving.worker_role import WorkerRoles

    metrics.serve_as("flip-test")
    roles = WorkerRoles("decode", {metrics.RUNNING: lambda: 3.0})
    roles.flip("prefill")
    value = REGISTRY.get_sample_value
    assert value(names.RUNNING, {"role": "prefill"}) == 3
    assert value(names.RUNNING, {"role": "decode"}) is None  # a scrape counts the worker once
    assert value(names.VLLM_RUNNING, {"model_name": "flip-test", "engine": "0"}) == 3
