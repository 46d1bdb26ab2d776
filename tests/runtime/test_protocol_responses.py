"""The router's OpenAI protocol layer: responses and streams the official client parses, SSE
framing, and an OpenAPI document that agrees with the validation."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from protocol_support import (
    CHAT,
    CHAT_BAD,
    COMPLETION_BAD,
    MODEL,
    SERVED,
    chat,
    completion,
    request_validator,
)

from cleave.runtime.engine.sequence import FinishReason, TokenLogprob
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import response_models as rm
from cleave.runtime.serving import responses
from cleave.runtime.serving.openapi import openapi_document, openapi_json

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the transport openai 3.x is built on


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


def wire(body: rm.Wire) -> Any:
    """The body as a client reads it."""
    return json.loads(body.model_dump_json())


def test_usage() -> None:
    assert wire(responses.usage(10, 4, cached_tokens=8)) == {
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
    body = wire(rm.Completion(id="cmpl-1", created=1700, model=MODEL, choices=[
        rm.CompletionChoice(index=0, text="Hel wörld",
                            logprobs=rm.CompletionLogprobs.model_validate(logprobs),
                            finish_reason=responses.api_finish_reason(FinishReason.LENGTH))],
        usage=responses.usage(5, 2, 4)))
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
    body = wire(rm.ChatCompletion(id="chatcmpl-1", created=1700, model=MODEL, choices=[
        rm.ChatCompletionChoice(index=0, message=rm.ChatCompletionMessage(content="Hel wörld"),
                                logprobs=rm.ChoiceLogprobs.model_validate(logprobs),
                                finish_reason="stop")],
        usage=responses.usage(5, 2)))
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
    body = wire(responses.models_list(["a", "b"], 1700, 4096, "org/model"))
    for item in body["data"]:
        openai.types.Model.model_validate(item)
    models = list(client_for([body]).models.list())
    assert [m.id for m in models] == ["a", "b"] and models[0].owned_by == "cleave"
    # vLLM's extra fields, which clients read through the SDK's model_extra
    assert models[0].model_extra == {"root": "org/model", "parent": None, "max_model_len": 4096}


def test_completion_stream() -> None:
    lp = responses.completion_logprobs(LOGPROBS[:1], TOKENS.__getitem__)
    models = [responses.completion_chunk("c", 1, MODEL, "Hel", logprobs=lp),
              responses.completion_chunk("c", 1, MODEL, " wörld"),
              responses.completion_chunk("c", 1, MODEL, "", FinishReason.STOP),
              responses.usage_chunk("c", 1, MODEL, responses.usage(3, 2), chat=False)]
    chunks = [wire(c) for c in models]
    openai.types.Completion.model_validate(chunks[-2])
    openai.types.Completion.model_validate(chunks[-1])
    # The client types a completion choice's finish_reason as never null, yet OpenAI itself
    # streams null until the last chunk, as we do; so the stream is read the way the client
    # normally reads it (unvalidated), and only the chunks with a reason validate strictly.
    assert chunks[0]["choices"][0]["finish_reason"] is None
    stream = b"".join(map(responses.sse, models)) + responses.SSE_DONE
    got = list(client_for([stream], strict=False).completions.create(
        model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in got if c.choices) == "Hel wörld"
    assert [c.choices[0].finish_reason for c in got[:3]] == [None, None, "stop"]
    assert got[-1].choices == [] and got[-1].usage is not None
    assert got[-1].usage.completion_tokens == 2


def test_chat_stream() -> None:
    models = [responses.chat_chunk("c", 1, MODEL, None, role_first=True),
              responses.chat_chunk("c", 1, MODEL, "Hel", role_first=False),
              responses.chat_chunk("c", 1, MODEL, " wörld", role_first=False,
                             logprobs=responses.chat_logprobs(LOGPROBS[1:], TOKENS.__getitem__)),
              responses.chat_chunk("c", 1, MODEL, None, role_first=False,
                             finish_reason=FinishReason.LENGTH),
              responses.usage_chunk("c", 1, MODEL, responses.usage(3, 2), chat=True)]
    chunks = [wire(c) for c in models]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[3]["choices"][0]["delta"] == {}
    for c in chunks:
        openai.types.chat.ChatCompletionChunk.model_validate(c)
    stream = b"".join(map(responses.sse, models)) + responses.SSE_DONE
    got = list(client_for([stream]).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}))
    assert got[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hel wörld"
    assert got[3].choices[0].finish_reason == "length"
    assert got[-1].usage is not None and got[-1].usage.prompt_tokens == 3


def test_role_and_text_in_one_chunk() -> None:
    chunk = wire(responses.chat_chunk("c", 1, MODEL, "Hi", role_first=True))
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
    frame = responses.sse(rm.CompletionUsage.of(3, 1, None))
    assert frame == (b'data: {"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,'
                     b'"prompt_tokens_details":null}\n\n')
    text = responses.sse(rm.DetokenizeResponse(prompt="wörld\n"))
    assert text == 'data: {"prompt":"wörld\\n"}\n\n'.encode()  # newlines inside stay escaped
    assert text.count(b"\n") == 2
    assert responses.SSE_DONE == b"data: [DONE]\n\n"


def test_logprobs_are_always_json_numbers() -> None:
    """-inf and NaN become OpenAI's floor (JSON has neither); +inf is no logprob at all."""
    entry = rm.TopLogprob(token="a", logprob=math.nan, bytes=[97])
    assert entry.logprob == responses.MIN_LOGPROB
    with pytest.raises(ValueError):
        rm.TopLogprob(token="a", logprob=math.inf, bytes=[97])


def test_openapi_document() -> None:
    doc = openapi_document([MODEL], vocab_size=100)
    doc = json.loads(json.dumps(doc, allow_nan=False))
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/health", "/ready", "/metrics",
                                 "/tokenize", "/detokenize", "/version"}  # the last: vLLM's
    schemas = doc["components"]["schemas"]
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/CompletionRequest"}
    schema = schemas["CompletionRequest"]
    assert schema["required"] == ["model", "prompt"] and not schema["additionalProperties"]
    assert schema["properties"]["model"]["enum"] == [MODEL]
    assert schema["properties"]["max_tokens"]["anyOf"] == [
        {"type": "integer", "minimum": 1, "maximum": api.MAX_TOKENS_LIMIT}, {"type": "null"}]
    assert schemas["TokenId"] == {"type": "integer", "minimum": 0, "maximum": 99}
    assert schemas["ChatRequest"]["required"] == ["model", "messages"]
    assert schemas["Error"]["required"] == ["error"]
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    assert openapi_document([])["paths"]["/v1/models"]


def test_the_served_openapi_document_is_built_once() -> None:
    """/openapi.json needs no key, and building the document costs ~60 ms of the router's event
    loop: a client looping on it must not be able to stall every stream."""
    served = openapi_json((MODEL,))
    assert openapi_json((MODEL,)) is served
    assert json.loads(served) == json.loads(json.dumps(openapi_document([MODEL])))


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
    {"n": 3, "best_of": 4, "echo": True, "logit_bias": {"7": -100, "8": 2.5},
     "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.3, "min_p": 0.1,
     "min_tokens": 2, "stop_token_ids": [1, 2]},
    {"stream": False, "stream_options": {"include_usage": True}}, {"user": 5, "new": None},
]
GOOD_CHATS: list[dict[str, Any]] = [
    {}, {"messages": [{"role": "assistant"}]}, {"top_logprobs": 3},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    {"messages": [{"role": "tool", "content": []}]}, {"response_format": {"type": "text"}},
    {"tools": []}, {"max_tokens": 3, "max_completion_tokens": None}, {"logprobs": False},
    {"response_format": {"type": "json_object"}}, {"guided_choice": ["a", "b"]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"structured_outputs": {"regex": "a+"}}, {"guided_json": "{}"},
    {"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                  "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}},
     "parallel_tool_calls": False},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "1", "tool_call_id": "c"}]},
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
    the schema finds real bugs, not disagreements."""
    validator = request_validator(path)
    json_bodies = [b for b in bodies if _is_json(b)]  # NaN and Infinity are outside the schema
    assert len(json_bodies) > 40
    assert [b for b in json_bodies if validator.is_valid(b) != _accepted(parse, b)] == []


def _is_json(body: object) -> bool:
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        return False
    return True
