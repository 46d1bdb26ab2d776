"""The generated OpenAPI document and the validation agree on bodies a fuzzer makes up (what a
schema-driven fuzzer such as schemathesis relies on): any field, known or not, with any JSON
value. Fields whose remaining rules no schema states (best_of against n, prompt_logprobs not
streamed, a named tool that must exist) are left out of the pool. The structured-output fields
come one at a time (at most one per request is such a rule), with values that compile or that
the document refuses (compiling is another): structured_outputs with null, unknown, missing and
extra keys among them. And the other way: responses built from made-up worker output (any
text, any logprob, n choices, usage, echo) match the document's response schemas and the openai
client's types."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from protocol_support import MODEL, SERVED, chat, completion, request_validator
from pydantic import BaseModel
from response_support import check_reply

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import responses, structured_fields
from cleave.runtime.serving.logprobs import PromptScores
from cleave.runtime.serving.openapi import openapi_document
from cleave.runtime.serving.wire import LineLogprob, TokenLine

STRUCTURED = set(structured_fields.FIELDS)
CROSS_RULES = {"best_of", "prompt_logprobs", "tools", "tool_choice", "messages", "prompt",
               *STRUCTURED}
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([1 << 63, -(1 << 63) - 1]),
    st.floats(-3, 3, allow_nan=False), st.floats(0.5, 1.5).map(round),
    st.sampled_from(["", "a", "auto", "none", "text", "default", "x" * 1025, "5"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=5),
                   st.dictionaries(st.sampled_from(["5", "a", "include_usage", "-1"]), SCALARS,
                                   max_size=2))
NOT_STRINGS = SCALARS.filter(lambda v: not isinstance(v, str))
SCHEMAS = st.sampled_from([{}, {"type": "object"}, {"type": "string", "maxLength": 3}])
# A string is taken as a schema's JSON text, or a grammar: the document cannot check either,
# so only ones that compile are drawn.
JSON_SCHEMAS = st.one_of(NOT_STRINGS, SCHEMAS, SCHEMAS.map(json.dumps))
GRAMMARS = st.one_of(NOT_STRINGS,
                     st.sampled_from(["", 'start: "a" | "b"', 'root ::= "a" [b-c]?']))


def _objects(pools: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with none, some or all of these keys, each value null half the time (JSON null
    is "not given" for optional fields, refused for required ones), else from its pool."""
    return st.lists(st.sampled_from(sorted(pools)), unique=True, max_size=3).flatmap(
        lambda keys: st.fixed_dictionaries({k: st.none() | pools[k] for k in keys}))


_FORMATS = _objects({
    "type": st.one_of(SCALARS, st.sampled_from(["text", "json_object", "json_schema"])),
    "json_schema": st.one_of(VALUES, _objects({"schema": st.one_of(NOT_STRINGS, SCHEMAS),
                                               "name": SCALARS, "strict": SCALARS})),
    "nonsense": SCALARS})
_OUTPUTS = _objects({"json": JSON_SCHEMAS, "regex": VALUES, "choice": VALUES,
                     "grammar": GRAMMARS, "json_object": SCALARS, "nonsense": SCALARS})
_POOLS: dict[str, st.SearchStrategy[Any]] = {
    "response_format": st.one_of(VALUES, _FORMATS), "structured_outputs": st.one_of(
        VALUES, _OUTPUTS), "guided_json": JSON_SCHEMAS, "guided_regex": VALUES,
    "guided_choice": VALUES, "guided_grammar": GRAMMARS}
# structured_outputs, whose rules are the models' own, drawn more often than the others.
ONE_STRUCTURED = st.sampled_from([*sorted(_POOLS), *["structured_outputs"] * 3]).flatmap(
    lambda name: _POOLS[name].map(lambda value: {name: value}))
# Where the document and the server once disagreed (issue 16): each is refused by both now.
EXAMPLES = ({"structured_outputs": {"json_object": None}},
            {"structured_outputs": {"regex": "a", "choice": None}})


def _fields(model: type[BaseModel]) -> list[str]:
    return [*sorted(set(model.model_fields) - CROSS_RULES), "max_token", "nonsense"]


def _agree(path: str, parse: Callable[..., object], body: dict[str, Any]) -> None:
    validator = request_validator(path)
    try:
        parse(body, SERVED)
        accepted = True
    except api.APIError:
        accepted = False
    assert validator.is_valid(body) == accepted, body


def _bodies(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda fields, structured: {**fields, **structured},
                     st.dictionaries(st.sampled_from(_fields(model)), VALUES, max_size=4),
                     st.just({}) | ONE_STRUCTURED)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies(api.COMPLETION))
def test_completions(fields: dict[str, Any]) -> None:
    _agree("/v1/completions", api.parse_completion_request, completion(**fields))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies(api.CHAT))
def test_chat_completions(fields: dict[str, Any]) -> None:
    _agree("/v1/chat/completions", api.parse_chat_request, chat(**fields))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), ONE_STRUCTURED)
@example(False, EXAMPLES[0])
@example(True, EXAMPLES[1])
def test_a_structured_field_alone(is_chat: bool, fields: dict[str, Any]) -> None:
    """One structured-output field in an otherwise valid body: its own rules alone decide
    (beside the fields above, another field's mistake would often hide a disagreement)."""
    if is_chat:
        _agree("/v1/chat/completions", api.parse_chat_request, chat(**fields))
    else:
        _agree("/v1/completions", api.parse_completion_request, completion(**fields))


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


LOGPROBS = st.one_of(st.floats(max_value=0), st.just(float("nan")))  # -inf included


@st.composite
def _lines(draw: st.DrawFn, choices: int, logprobs: bool) -> list[list[TokenLine]]:
    """What workers might send for each choice: text pieces, logprobs, a last line."""
    out = []
    for _ in range(choices):
        texts = draw(st.lists(st.text(max_size=4), min_size=1, max_size=3))
        out.append([TokenLine(
            token_ids=[i], text=t, finished=i == len(texts) - 1,
            finish_reason=draw(st.sampled_from(["stop", "length", "abort"]))
            if i == len(texts) - 1 else None,
            prompt_tokens=3, completion_tokens=i + 1,
            cached_tokens=draw(st.sampled_from([None, 0, 2])),
            logprobs=[LineLogprob(token_id=i, logprob=draw(LOGPROBS),
                                  top=[(7, draw(LOGPROBS))])] if logprobs else [])
            for i, t in enumerate(texts)])
    return out


def _scored(lines: list[list[TokenLine]], data: st.DataObject) -> list[list[TokenLine]]:
    """Sequence 0's first line with the prompt's scores, as a worker sends them."""
    entries = [LineLogprob(token_id=t, logprob=data.draw(LOGPROBS), rank=data.draw(
        st.integers(1, 9)), top=[(t + 1, data.draw(LOGPROBS))]) for t in (4, 5)]
    first = lines[0][0].model_copy(update={"prompt_logprobs": entries})
    return [[first, *lines[0][1:]], *lines[1:]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.integers(1, 3), st.booleans(), st.booleans(), st.text(max_size=3),
       st.booleans(), st.data())
def test_built_responses_match_the_document(is_chat: bool, n: int, include_usage: bool,
                                            logprobs: bool, echo: str, prompt_top: bool,
                                            data: st.DataObject) -> None:
    """Prompt scores as the router asks for them: vLLM's field (``prompt_top``, not streamed),
    and a completion's echo with logprobs."""
    lines = data.draw(_lines(n, logprobs))
    echo_top = 1 if logprobs and echo and not is_chat else None

    def scores(streamed: bool) -> PromptScores | None:
        top = None if streamed or not prompt_top else 2
        return None if top is None and echo_top is None else PromptScores(3, top, echo_top)

    if prompt_top or echo_top is not None:
        lines = _scored(lines, data)
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    token_text = "tok{}é".format
    writer = responses.StreamWriter("id-1", MODEL, is_chat, include_usage, token_text, logprobs,
                                    choices=n, echo=echo, prompt=scores(True))
    frames = [f for index, choice in enumerate(lines) for line in choice
              for f in writer.chunks(line, index)]
    check_reply("POST", path, 200, "text/event-stream", b"".join(frames) + responses.SSE_DONE)
    prompt = scores(False)
    if prompt is not None:
        prompt.take(lines[0][0])
    whole = responses.final_response("id-1", MODEL, is_chat, lines, token_text, logprobs, echo,
                                     prompt=prompt)
    check_reply("POST", path, 200, "application/json", whole.model_dump_json().encode())
