"""Several served model names, as vLLM's ``--served-model-name NAME [NAME ...]`` (issue 16):
a request may ask for any of them, ``/v1/models`` lists each, and responses and the ``vllm:*``
metrics' ``model_name`` label carry the first. A real router and worker, the official client."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_stack import Stack, post_raw, start_stack

FIRST, SECOND = "tiny-v2", "tiny"  # a versioned name, and the stable one clients keep
NAMES = (FIRST, SECOND)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("served-names-logs"), prefill=0,
                    decode=1, served=NAMES)
    yield s
    s.stop()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_every_name_in_order_each_with_its_context_length(
        client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == list(NAMES)
    for m in listed:
        assert (m.model_extra or {})["max_model_len"] > 0
        assert (m.model_extra or {})["root"] == listed[0].model_extra["root"]  # type: ignore[index]


def test_the_openapi_document_allows_every_name(stack: Stack) -> None:
    assert stack.router is not None
    doc = json.loads(urllib.request.urlopen(stack.router.url + "/openapi.json").read())
    enums = {tuple(n["enum"]) for n in _nodes(doc) if "enum" in n and FIRST in n["enum"]}
    assert enums == {NAMES}  # every request body's model, and nothing but the served names


def _nodes(node: object) -> Iterator[dict[str, object]]:
    if isinstance(node, dict):
        yield node
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            yield from _nodes(item)


@pytest.mark.parametrize("asked", NAMES)
def test_either_name_is_served_and_the_response_carries_the_first(
        client: openai.OpenAI, asked: str) -> None:
    done = client.completions.create(model=asked, prompt="hello", max_tokens=2, temperature=0)
    assert done.model == FIRST and done.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True))
    assert chunks and {c.model for c in chunks} == {FIRST}


def test_a_name_not_served_is_refused_as_before(client: openai.OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="tiny-v1", prompt="hello", max_tokens=2)
    assert refused.value.code == "model_not_found"
    assert all(n in refused.value.message for n in NAMES)  # it says what is served
    assert stack.router is not None
    tokenize = stack.router.url + "/tokenize"  # vLLM's endpoints take the same names
    status, body = post_raw(tokenize, json.dumps({"model": "tiny-v1", "prompt": "x"}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"  # type: ignore[index]
    assert post_raw(tokenize, json.dumps({"model": SECOND, "prompt": "x"}).encode())[0] == 200


def _model_names(url: str) -> set[str]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {s.labels["model_name"] for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("vllm:") and "model_name" in s.labels}


def test_the_vllm_series_of_router_and_worker_are_labelled_with_the_first_name(
        client: openai.OpenAI, stack: Stack) -> None:
    client.completions.create(model=SECOND, prompt="hello", max_tokens=2)
    assert stack.router is not None
    for url in (stack.router.url, stack.workers[0].url):
        assert _model_names(url) == {FIRST}
