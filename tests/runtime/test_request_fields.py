"""Unknown request fields and vLLM's extensions (issue 16): refused with a 400 naming the field
unless at a value that changes nothing; the OpenAPI document says the same."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.openapi import openapi_document

MODEL = "m"
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "Hello"}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _schema(path: str) -> dict[str, Any]:
    doc = openapi_document([MODEL])
    return {**doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            ["schema"], "components": doc["components"]}


@pytest.mark.parametrize("field, value", [
    ("max_token", 5),  # a typo must not silently mean the default
    ("min_p", 1.1), ("repetition_penalty", 0), ("min_tokens", -1), ("stop_token_ids", [-2]),
    ("length_penalty", 2), ("prompt_logprobs", 21),  # beyond the 20 logprobs takes too
    ("guided_whitespace_pattern", " "), ("structural_tag", "{}"), ("guided_grammar", ""),
    ("guided_choice", []), ("guided_regex", ""),  # honoured since issue 16 item 3, not these
    ("use_beam_search", True), ("include_stop_str_in_output", True),
    ("repetition_penalty", True),  # JSON's true is not 1
])
@pytest.mark.parametrize("path, body, parse", [
    ("/v1/completions", COMPLETION, api.parse_completion_request),
    ("/v1/chat/completions", CHAT, api.parse_chat_request)])
def test_refused_fields_get_a_400_naming_them(field: str, value: object, path: str,
                                              body: dict[str, Any], parse: Any) -> None:
    with pytest.raises(api.APIError) as refused:
        parse({**body, field: value}, [MODEL])
    assert refused.value.status == 400 and refused.value.param == field
    assert field in refused.value.message
    with pytest.raises(jsonschema.ValidationError):  # the document refuses it too
        jsonschema.validate({**body, field: value}, _schema(path))


@pytest.mark.parametrize("extra", [
    {"min_p": 0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
     "skip_special_tokens": True, "guided_json": None, "user": "someone",
     "metadata": {"k": "v"}, "priority": 0},
    # Honoured since issue 16 item 2: any in-range value.
    {"min_p": 0.2, "repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [2],
     "max_tokens": 5},
])
@pytest.mark.parametrize("path, body, parse", [
    ("/v1/completions", COMPLETION, api.parse_completion_request),
    ("/v1/chat/completions", CHAT, api.parse_chat_request)])
def test_no_op_values_are_accepted(extra: dict[str, Any], path: str, body: dict[str, Any],
                                   parse: Any) -> None:
    parse({**body, **extra}, [MODEL])
    jsonschema.validate({**body, **extra}, _schema(path))


def test_chat_only_no_ops() -> None:
    ok = {**CHAT, "tool_choice": "none", "add_generation_prompt": True}
    api.parse_chat_request(ok, [MODEL])
    jsonschema.validate(ok, _schema("/v1/chat/completions"))
    with pytest.raises(api.APIError) as refused:
        api.parse_chat_request({**CHAT, "tool_choice": "required"}, [MODEL])
    assert refused.value.param == "tool_choice"
    with pytest.raises(api.APIError):  # a chat field is unknown to completions
        api.parse_completion_request({**COMPLETION, "tool_choice": "none"}, [MODEL])
