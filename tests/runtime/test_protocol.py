"""The router's OpenAI protocol layer: strict validation, and shapes the official client parses."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cleave.runtime.engine.sequence import FinishReason, SamplingParams, TokenLogprob
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import responses
from cleave.runtime.serving.openapi import openapi_document

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the transport openai 3.x is built on

MODEL = "smollm2"
SERVED = [MODEL]
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, **fields}


# -- validation: bad bodies -----------------------------------------------------------------

COMMON_BAD: list[tuple[dict[str, Any], str | None]] = [
    ({"n": 2}, "n"), ({"n": 0}, "n"), ({"n": "1"}, "n"), ({"n": True}, "n"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.01}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": [1]}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": False}, "top_k"),
    ({"seed": "7"}, "seed"), ({"seed": 1 << 63}, "seed"), ({"seed": 0.5}, "seed"),
    ({"stop": ""}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"stop": 3}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"stop": {"a": 1}}, "stop"),
    ({"stream": "true"}, "stream"), ({"stream": 1}, "stream"),
    ({"stream_options": True}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"ignore_eos": 0}, "ignore_eos"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"model": ""}, "model"), ({"model": 3}, "model"), ({"model": None}, "model"),
]

COMPLETION_BAD: list[tuple[dict[str, Any], str | None]] = [
    *COMMON_BAD,
    ({"prompt": None}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [""]}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"), ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"), ({"prompt": {"text": "a"}}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": api.MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
]
CHAT_BAD: list[tuple[dict[str, Any], str | None]] = [
    *COMMON_BAD,
    ({"messages": None}, "messages"), ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"), ({"messages": {"role": "user"}}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [*CHAT, {"role": "bot", "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
    ({"max_completion_tokens": 8, "max_tokens": -1}, "max_tokens"),
    ({"logprobs": 1}, "logprobs"), ({"logprobs": "true"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


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
        logit_bias={}, suffix=None, ignore_eos=True, something_new={"x": 1}), SERVED)
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
        {"role": "tool", "content": "42"}]
    assert req.sampling_params(100) == SamplingParams(max_tokens=9, temperature=0.7,
                                                      stop=("x", "y"), logprobs=2)


def test_chat_max_tokens() -> None:
    assert api.parse_chat_request(chat(), SERVED).sampling_params(77).max_tokens == 77
    both = api.parse_chat_request(chat(max_tokens=5, max_completion_tokens=6), SERVED)
    assert both.max_tokens == 6


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
    with pytest.raises(AttributeError):
        req.prompt = "other"  # type: ignore[misc]


# -- responses, through the official client -------------------------------------------------

TOKENS = {1: "Hel", 2: "lo", 3: " wörld", 4: "!"}
LOGPROBS = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))),
            TokenLogprob(3, -float("inf"), ((4, float("nan")),))]


def client_for(replies: list[bytes | dict[str, Any]], status: int = 200,
               strict: bool = True) -> Any:
    """An openai client whose every request is answered by the next of ``replies``, with the
    client's strict response validation on unless asked otherwise."""
    queue: Iterator[bytes | dict[str, Any]] = iter(replies)

    def handler(_: Any) -> Any:
        reply = next(queue)
        if isinstance(reply, bytes):
            return httpx.Response(status, content=reply,
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(status, json=reply)

    return openai.OpenAI(api_key="k", base_url="http://router/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)),
                         _strict_response_validation=strict)


def test_usage() -> None:
    assert responses.usage(10, 4, cached_tokens=8) == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8}}


@pytest.mark.parametrize(("reason", "expected"), [
    (FinishReason.STOP, "stop"), (FinishReason.LENGTH, "length"), (FinishReason.ABORT, "stop"),
    (FinishReason.PREFILL_DONE, "stop"), ("length", "length"),
])
def test_finish_reasons(reason: FinishReason | str, expected: str) -> None:
    assert responses.api_finish_reason(reason) == expected


def test_completion_response() -> None:
    logprobs = responses.completion_logprobs(LOGPROBS, TOKENS.__getitem__)
    body = responses.completion_response("cmpl-1", 1700, MODEL, "Hel wörld", FinishReason.LENGTH,
                                   responses.usage(5, 2, 4), logprobs)
    json.dumps(body, allow_nan=False)
    parsed = openai.types.Completion.model_validate(body)
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4
    lp = parsed.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["Hel", " wörld"] and lp.text_offset == [0, 3]
    assert lp.token_logprobs == [-0.5, responses.MIN_LOGPROB]  # -inf is not JSON
    assert lp.top_logprobs == [{"Hel": -0.5, "lo": -1.5}, {"!": responses.MIN_LOGPROB}]

    got = client_for([body]).completions.create(model=MODEL, prompt="x", logprobs=1)
    assert got.id == "cmpl-1" and got.choices[0].text == "Hel wörld"


def test_completion_logprobs_offset_continues_a_stream() -> None:
    lp = responses.completion_logprobs(LOGPROBS[1:], TOKENS.__getitem__, text_offset=3)
    assert lp["text_offset"] == [3]


def test_chat_response() -> None:
    logprobs = responses.chat_logprobs(LOGPROBS, TOKENS.__getitem__)
    body = responses.chat_response("chatcmpl-1", 1700, MODEL, "Hel wörld", FinishReason.STOP,
                             responses.usage(5, 2), logprobs)
    json.dumps(body, allow_nan=False)
    parsed = openai.types.chat.ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hel wörld"
    assert parsed.choices[0].message.role == "assistant"
    lp = parsed.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert lp.content[1].token == " wörld" and lp.content[1].bytes == list(" wörld".encode())
    assert lp.content[1].logprob == responses.MIN_LOGPROB
    assert [t.token for t in lp.content[0].top_logprobs] == ["Hel", "lo"]

    got = client_for([body]).chat.completions.create(model=MODEL, messages=CHAT)
    assert got.choices[0].finish_reason == "stop" and got.usage is not None
    assert got.usage.total_tokens == 7


def test_models_list() -> None:
    body = responses.models_list(["a", "b"], 1700)
    for item in body["data"]:
        openai.types.Model.model_validate(item)
    models = list(client_for([body]).models.list())
    assert [m.id for m in models] == ["a", "b"] and models[0].owned_by == "cleave"


def test_completion_stream() -> None:
    lp = responses.completion_logprobs(LOGPROBS[:1], TOKENS.__getitem__)
    chunks = [responses.completion_chunk("c", 1, MODEL, "Hel", logprobs=lp),
              responses.completion_chunk("c", 1, MODEL, " wörld"),
              responses.completion_chunk("c", 1, MODEL, "", FinishReason.STOP),
              responses.usage_chunk("c", 1, MODEL, responses.usage(3, 2), chat=False)]
    openai.types.Completion.model_validate(chunks[-2])
    openai.types.Completion.model_validate(chunks[-1])
    # The client types a completion choice's finish_reason as never null, yet OpenAI itself
    # streams null until the last chunk, as we do; so the stream is read the way the client
    # normally reads it (unvalidated), and only the chunks with a reason validate strictly.
    assert chunks[0]["choices"][0]["finish_reason"] is None
    stream = b"".join(map(responses.sse, chunks)) + responses.SSE_DONE
    got = list(client_for([stream], strict=False).completions.create(
        model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in got if c.choices) == "Hel wörld"
    assert [c.choices[0].finish_reason for c in got[:3]] == [None, None, "stop"]
    assert got[-1].choices == [] and got[-1].usage is not None
    assert got[-1].usage.completion_tokens == 2


def test_chat_stream() -> None:
    chunks = [responses.chat_chunk("c", 1, MODEL, None, role_first=True),
              responses.chat_chunk("c", 1, MODEL, "Hel", role_first=False),
              responses.chat_chunk("c", 1, MODEL, " wörld", role_first=False,
                             logprobs=responses.chat_logprobs(LOGPROBS[1:], TOKENS.__getitem__)),
              responses.chat_chunk("c", 1, MODEL, None, role_first=False,
                             finish_reason=FinishReason.LENGTH),
              responses.usage_chunk("c", 1, MODEL, responses.usage(3, 2), chat=True)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[3]["choices"][0]["delta"] == {}
    for c in chunks:
        openai.types.chat.ChatCompletionChunk.model_validate(c)
    stream = b"".join(map(responses.sse, chunks)) + responses.SSE_DONE
    got = list(client_for([stream]).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}))
    assert got[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hel wörld"
    assert got[3].choices[0].finish_reason == "length"
    assert got[-1].usage is not None and got[-1].usage.prompt_tokens == 3


def test_role_and_text_in_one_chunk() -> None:
    chunk = responses.chat_chunk("c", 1, MODEL, "Hi", role_first=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}


@pytest.mark.parametrize(("err", "exc"), [
    (api.APIError(400, "bad n", param="n"), "BadRequestError"),
    (api.APIError(404, "no such model", param="model", code="model_not_found"), "NotFoundError"),
    (api.APIError(429, "busy", "rate_limit_exceeded"), "RateLimitError"),
    (api.APIError(503, "no workers", "service_unavailable"), "InternalServerError"),
])
def test_errors_reach_the_client(err: api.APIError, exc: str) -> None:
    with pytest.raises(getattr(openai, exc)) as e:
        client_for([err.body()], status=err.status).completions.create(model=MODEL, prompt="x")
    assert e.value.status_code == err.status
    assert (e.value.param, e.value.code, e.value.type) == (err.param, err.code, err.type)


# -- framing and the OpenAPI document -------------------------------------------------------

def test_sse_framing() -> None:
    frame = responses.sse({"text": "wörld", "n": 1})
    assert frame == 'data: {"text":"wörld","n":1}\n\n'.encode()
    assert frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[len(b"data: "):]) == {"text": "wörld", "n": 1}
    assert responses.sse({"text": "a\nb"}).count(b"\n") == 2  # newlines inside stay escaped
    assert responses.SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        responses.sse({"x": math.nan})


def test_openapi_document() -> None:
    doc = openapi_document([MODEL], vocab_size=100)
    doc = json.loads(json.dumps(doc, allow_nan=False))
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/health", "/ready", "/metrics"}
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert schema["required"] == ["model", "prompt"]
    assert schema["properties"]["model"]["enum"] == [MODEL]
    assert schema["properties"]["max_tokens"]["maximum"] == api.MAX_TOKENS_LIMIT
    chat_schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert chat_schema["required"] == ["model", "messages"]
    assert "Error" in doc["components"]["schemas"]
    assert openapi_document([])["paths"]["/v1/models"]


def _request_schema(path: str) -> dict[str, Any]:
    doc = openapi_document(SERVED)
    schema: dict[str, Any] = doc["paths"][path]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    return {**schema, "components": doc["components"]}


def _accepted(parse: Callable[..., object], body: dict[str, Any]) -> bool:
    try:
        parse(body, SERVED)
    except api.APIError:
        return False
    return True


GOOD_COMPLETIONS: list[dict[str, Any]] = [
    {}, {"prompt": [[1]]}, {"prompt": ["a"]}, {"prompt": [0, 5]}, {"echo": False},
    {"logprobs": 20}, {"stop": ["a"] * 4}, {"temperature": 2, "top_p": 1, "top_k": -1},
    {"best_of": 1, "suffix": "", "logit_bias": {}, "presence_penalty": 0.0},
    {"stream": False, "stream_options": {"include_usage": True}}, {"user": 5, "new": None},
]
GOOD_CHATS: list[dict[str, Any]] = [
    {}, {"messages": [{"role": "assistant"}]}, {"top_logprobs": 3},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    {"messages": [{"role": "tool", "content": []}]}, {"response_format": {"type": "text"}},
    {"tools": []}, {"max_tokens": 3, "max_completion_tokens": None}, {"logprobs": False},
]


@pytest.mark.parametrize(("path", "parse", "bodies"), [
    ("/v1/completions", api.parse_completion_request,
     [completion(**f) for f, _ in COMPLETION_BAD] + [completion(**f) for f in GOOD_COMPLETIONS]
     + [{"model": MODEL}, {"prompt": "x"}, {**completion(), "model": "other"}]),
    ("/v1/chat/completions", api.parse_chat_request,
     [chat(**f) for f, _ in CHAT_BAD] + [chat(**f) for f in GOOD_CHATS]
     + [{"model": MODEL}, {"messages": CHAT}, {**chat(), "model": "other"}]),
])
def test_schema_agrees_with_validation(path: str, parse: Callable[..., object],
                                       bodies: list[dict[str, Any]]) -> None:
    """What the schema allows is served and what it forbids is refused, so a fuzzer driven by
    the schema finds real bugs, not disagreements. Runs where jsonschema is installed."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(_request_schema(path))
    json_bodies = [b for b in bodies if _is_json(b)]  # NaN and Infinity are outside the schema
    assert len(json_bodies) > 40
    assert [b for b in json_bodies if validator.is_valid(b) != _accepted(parse, b)] == []


def _is_json(body: object) -> bool:
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        return False
    return True
