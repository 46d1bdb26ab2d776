"""The generated OpenAPI document and the validation agree on bodies a fuzzer makes up (what a
schema-driven fuzzer such as schemathesis relies on): any field, known or not, with any JSON
value. Fields whose remaining rules no schema states (best_of against n, prompt_logprobs not
streamed, a grammar that must compile, a named tool that must exist) are left out of the pool."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_support import MODEL, SERVED, chat, completion
from pydantic import BaseModel

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.openapi import openapi_document

CROSS_RULES = {"best_of", "prompt_logprobs", "tools", "tool_choice", "response_format",
               "guided_json", "guided_regex", "guided_choice", "structured_outputs", "messages",
               "prompt"}
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([1 << 63, -(1 << 63) - 1]),
    st.floats(-3, 3, allow_nan=False), st.floats(0.5, 1.5).map(round),
    st.sampled_from(["", "a", "auto", "none", "text", "default", "x" * 1025, "5"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=5),
                   st.dictionaries(st.sampled_from(["5", "a", "include_usage", "-1"]), SCALARS,
                                   max_size=2))


@functools.cache
def _validator(path: str) -> jsonschema.Draft202012Validator:
    doc = openapi_document(SERVED)
    return jsonschema.Draft202012Validator(
        {**doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
         "components": doc["components"]})


def _fields(model: type[BaseModel]) -> list[str]:
    return [*sorted(set(model.model_fields) - CROSS_RULES), "max_token", "nonsense"]


def _agree(path: str, parse: Callable[..., object], body: dict[str, Any]) -> None:
    validator = _validator(path)
    try:
        parse(body, SERVED)
        accepted = True
    except api.APIError:
        accepted = False
    assert validator.is_valid(body) == accepted, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_fields(api.COMPLETION)), VALUES, max_size=4))
def test_completions(fields: dict[str, Any]) -> None:
    _agree("/v1/completions", api.parse_completion_request, completion(**fields))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_fields(api.CHAT)), VALUES, max_size=4))
def test_chat_completions(fields: dict[str, Any]) -> None:
    _agree("/v1/chat/completions", api.parse_chat_request, chat(**fields))


def test_every_model_field_is_in_the_document() -> None:
    """The document is generated from the models: each field the validation knows, the
    schema names, and no other."""
    schemas = openapi_document([MODEL])["components"]["schemas"]
    for model in (api.COMPLETION, api.CHAT):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)


@pytest.mark.parametrize("vocab", [None, 100])
def test_token_ids_are_bounded_by_the_vocabulary_when_known(vocab: int | None) -> None:
    doc = openapi_document([MODEL], vocab_size=vocab)
    validator = jsonschema.Draft202012Validator(
        {**doc["components"]["schemas"]["CompletionRequest"], "components": doc["components"]})
    assert validator.is_valid(completion(prompt=[99]))
    assert validator.is_valid(completion(prompt=[100])) == (vocab is None)
