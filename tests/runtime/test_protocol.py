"""The router's OpenAI protocol layer: strict validation of completion and chat requests."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from protocol_support import CHAT_BAD, COMPLETION_BAD, MODEL, SERVED, chat, completion
from pydantic import ValidationError

from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving import protocol as api

# -- validation: bad bodies -----------------------------------------------------------------

@pytest.mark.parametrize("body", [None, [], "x", 3, ["model"], True])
@pytest.mark.parametrize("parse", [api.parse_completion_request, api.parse_chat_request])
def test_body_must_be_an_object(body: object, parse: Callable[..., object]) -> None:
    with pytest.raises(api.APIError) as e:
        parse(body, SERVED)
    assert (e.value.status, e.value.param) == (400, None)
    assert "JSON object" in e.value.message


@pytest.mark.parametrize(("fields", "param"), COMPLETION_BAD)
def test_bad_completion_requests(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(api.APIError) as e:
        api.parse_completion_request(completion(**fields), SERVED)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error", param)
    assert e.value.body()["error"]["param"] == param


def test_prompt_is_required() -> None:
    with pytest.raises(api.APIError) as e:
        api.parse_completion_request({"model": MODEL}, SERVED)
    assert (e.value.status, e.value.param) == (400, "prompt")


@pytest.mark.parametrize(("fields", "param"), CHAT_BAD)
def test_bad_chat_requests(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(api.APIError) as e:
        api.parse_chat_request(chat(**fields), SERVED)
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("parse", [api.parse_completion_request, api.parse_chat_request])
def test_unknown_model_is_404_model_not_found(parse: Callable[..., object]) -> None:
    with pytest.raises(api.APIError) as e:
        parse({**completion(), **chat(), "model": "gpt-4"}, SERVED)
    err = e.value
    assert (err.status, err.type, err.param, err.code) == (
        404, "invalid_request_error", "model", "model_not_found")
    assert "gpt-4" in err.message and MODEL in err.message


def test_error_body_shape() -> None:
    err = api.APIError(503, "no decode worker", "service_unavailable")
    assert err.body() == {"error": {"message": "no decode worker", "type": "service_unavailable",
                                    "param": None, "code": None}}
    assert str(err) == "no decode worker"
    assert json.loads(json.dumps(err.body())) == err.body()


# -- validation: good bodies ----------------------------------------------------------------

def test_completion_defaults() -> None:
    req = api.parse_completion_request(completion(), SERVED)
    assert req.prompt == "Hello" and req.model == MODEL
    assert not req.stream and not req.include_usage and req.max_tokens is None
    assert req.sampling_params(api.DEFAULT_COMPLETION_MAX_TOKENS) == SamplingParams(
        max_tokens=16, temperature=1.0)  # OpenAI's defaults, not the engine's greedy one


def test_completion_every_field() -> None:
    req = api.parse_completion_request(completion(
        prompt=[[1, 2, 3]], max_tokens=40, temperature=0, top_p=0.5, top_k=-1, seed=-7,
        stop="\n", stream=True, stream_options={"include_usage": True}, logprobs=3, n=1,
        presence_penalty=0, frequency_penalty=0.0, user="u", echo=False, best_of=1,
        logit_bias={}, suffix=None, ignore_eos=True, min_p=0, guided_json=None), SERVED)
    assert req.prompt == (1, 2, 3)
    assert req.stream and req.include_usage
    assert req.sampling_params(16) == SamplingParams(
        max_tokens=40, temperature=0.0, top_k=0, top_p=0.5, seed=-7, stop=("\n",),
        ignore_eos=True, logprobs=3)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("x", "x"), (["x"], "x"), ([5], (5,)), ([[0, 7]], (0, 7)), ([1.0, 2], (1, 2)),
])
def test_prompt_forms(prompt: object, expected: object) -> None:
    assert api.parse_completion_request(completion(prompt=prompt), SERVED).prompt == expected


def test_nulls_mean_not_given() -> None:
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                           "stream", "stream_options", "logprobs", "n", "presence_penalty",
                           "echo", "best_of", "suffix", "logit_bias", "ignore_eos"])
    req = api.parse_completion_request(completion(**nulls), SERVED)
    assert req.sampling_params(16) == SamplingParams(max_tokens=16, temperature=1.0)


def test_integral_floats_are_integers() -> None:
    """JSON Schema's "integer" admits 8.0, and so must we, or the schema would lie."""
    req = api.parse_completion_request(completion(max_tokens=8.0, seed=3.0, top_k=2.0), SERVED)
    assert (req.max_tokens, req.seed, req.top_k) == (8, 3, 2)


def test_include_usage_needs_stream() -> None:
    req = api.parse_completion_request(completion(stream_options={"include_usage": True}), SERVED)
    assert not req.stream and not req.include_usage


def test_chat_fields() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]
    req = api.parse_chat_request(chat(messages=messages, max_tokens=9, logprobs=True,
                                      top_logprobs=2, stop=["x", "y"], temperature=0.7,
                                      tools=[], response_format={"type": "text"}), SERVED)
    assert req.template_messages() == [
        {"role": "developer", "content": "be brief"}, {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "t1"}]
    assert req.sampling_params(100) == SamplingParams(max_tokens=9, temperature=0.7,
                                                      stop=("x", "y"), logprobs=2)


def test_chat_max_tokens() -> None:
    assert api.parse_chat_request(chat(), SERVED).sampling_params(77).max_tokens == 77
    both = api.parse_chat_request(chat(max_tokens=5, max_completion_tokens=6), SERVED)
    assert both.sampling_params(77).max_tokens == 6


@pytest.mark.parametrize(("fields", "logprobs"), [
    ({}, None), ({"logprobs": False, "top_logprobs": 3}, None), ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_logprobs(fields: dict[str, Any], logprobs: int | None) -> None:
    assert api.parse_chat_request(chat(**fields), SERVED).sampling_params(8).logprobs == logprobs


def test_sampling_params_errors_become_api_errors() -> None:
    req = api.parse_chat_request(chat(), SERVED)
    with pytest.raises(api.APIError) as e:
        req.sampling_params(0)  # the prompt left no room in the context
    assert (e.value.status, e.value.param) == (400, "max_tokens")


def test_requests_are_frozen() -> None:
    req = api.parse_completion_request(completion(), SERVED)
    with pytest.raises(ValidationError, match="frozen"):
        req.prompt = "other"  # type: ignore[misc]
