"""Structured-output fields at the router's edge (issue 16): one definition. The models
(structured_models.py) state the types and structured_outputs' "exactly one key, not null",
and the generated OpenAPI document says the same; structured_fields.py compiles the validated
values and refuses what no schema states, each a 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from protocol_support import SERVED, chat, completion, request_validator

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import structured_fields

ENDPOINTS = [("/v1/completions", completion, api.parse_completion_request),
             ("/v1/chat/completions", chat, api.parse_chat_request)]
Build = Callable[..., dict[str, Any]]


@pytest.mark.parametrize("outputs, accepted", [
    # The two bodies the document and the server once disagreed on: now both refuse them.
    ({"json_object": None}, False),
    ({"regex": "a", "choice": None}, False),
    ({"regex": "a", "nonsense": 1}, False), ({}, False), ({"json_object": False}, False),
    ({"json_object": 1}, False), ({"choice": []}, False), ({"grammar": ""}, False),
    ({"json": 5}, False), ({"regex": None}, False),
    ({"json_object": True}, True), ({"regex": "a"}, True), ({"choice": ["a", "b"]}, True),
    ({"json": {"type": "object"}}, True), ({"json": '{"type": "string"}'}, True),
    ({"grammar": 'start: "a"'}, True),
])
@pytest.mark.parametrize("path, build, parse", ENDPOINTS)
def test_structured_outputs_one_key_not_null_in_document_and_server(
        outputs: dict[str, Any], accepted: bool, path: str, build: Build,
        parse: Callable[..., Any]) -> None:
    body = build(structured_outputs=outputs)
    assert request_validator(path).is_valid(body) is accepted
    if accepted:
        assert parse(body, SERVED).sampling_params(8).grammar is not None
        return
    with pytest.raises(api.APIError) as refused:
        parse(body, SERVED)
    assert refused.value.status == 400
    assert (refused.value.param or "").startswith("structured_outputs")


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"json_object": None}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": None}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
    ({"guided_json": "[1]"}, "guided_json"), ({"guided_json": "{"}, "guided_json"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a" * (1 << 16)}, "guided_regex"),  # beyond the size bound
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}},
     "response_format"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the later one
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_a_bad_structured_output_is_a_400_naming_the_field(fields: dict[str, Any],
                                                          param: str) -> None:
    with pytest.raises(api.APIError) as refused:
        api.parse_completion_request(completion(**fields), SERVED)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert f"'{param}'" in refused.value.message


@pytest.mark.parametrize("outputs, same", [
    ({"json": {"type": "object"}}, {"guided_json": '{"type": "object"}'}),
    ({"json_object": True}, {"response_format": {"type": "json_object"}}),
    ({"regex": "[a-c]+"}, {"guided_regex": "[a-c]+"}),
    ({"choice": ["a", "b \"c\""]}, {"guided_choice": ["a", "b \"c\""]}),
    ({"grammar": 'start: "x"'}, {"guided_grammar": 'start: "x"'}),
])
def test_each_structured_outputs_key_means_its_field(outputs: dict[str, Any],
                                                     same: dict[str, Any]) -> None:
    def grammar(fields: dict[str, Any]) -> str | None:
        return api.parse_chat_request(chat(**fields), SERVED).sampling_params(8).grammar

    assert grammar({"structured_outputs": outputs}) == grammar(same) is not None


def test_text_and_nulls_ask_for_no_grammar() -> None:
    req = api.parse_completion_request(completion(
        response_format={"type": "text"}, guided_regex=None, structured_outputs=None,
        guided_choice=["a"]), SERVED)  # text does not count as a second one
    assert req.sampling_params(8).grammar is not None
    plain = api.parse_completion_request(completion(response_format={"type": "text"}), SERVED)
    assert plain.sampling_params(8).grammar is None


def test_streamed_prompt_logprobs_are_refused_before_any_grammar_is_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[object] = []
    compile_grammar = structured_fields.grammar

    def recording(asked: Mapping[str, object]) -> str | None:
        compiled.append(asked)
        return compile_grammar(asked)

    monkeypatch.setattr(structured_fields, "grammar", recording)
    with pytest.raises(api.APIError) as refused:
        api.parse_completion_request(completion(
            stream=True, prompt_logprobs=1, guided_regex="(["), SERVED)  # both are wrong
    assert refused.value.param == "prompt_logprobs"
    assert compiled == []  # the refusal cost no compile
    api.parse_completion_request(completion(guided_regex="[a-c]+"), SERVED)
    assert len(compiled) == 1  # the recording sees the compiles that do happen
