"""The router's OpenAPI 3.1 document, describing what ``protocol.py`` accepts and returns.

Schema and validation must agree field for field: a fuzzer (schemathesis) sends what the schema
allows and expects it served, and what it forbids and expects a 4xx. Rules no schema can state
(prompt plus max_tokens within the context, token ids below the vocabulary size when that is not
given here) are the engine's, and answer 400 too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cleave.runtime.engine.sequence import MAX_LOGPROBS
from cleave.runtime.serving.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    ROLES,
)

Schema = dict[str, Any]


def _opt(kind: str, **limits: Any) -> Schema:
    """An optional field: JSON null means "not given", as OpenAI treats it."""
    return {"type": [kind, "null"], **limits}


def _obj(properties: Schema, required: Sequence[str] = (), **extra: Any) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required), **extra}


_STRING: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_MAX_TOKENS = _opt("integer", minimum=1, maximum=MAX_TOKENS_LIMIT)
_ERROR = _obj({"error": _obj({"message": _STRING, "type": _STRING,
                              "param": _opt("string"), "code": _opt("string")},
                             ["message", "type", "param", "code"])}, ["error"])
_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
               "prompt_tokens_details": _obj({"cached_tokens": _INT})},
              ["prompt_tokens", "completion_tokens", "total_tokens"])
_FINISH: Schema = {"enum": ["stop", "length"]}


def _common(models: Sequence[str]) -> Schema:
    zero_only = _opt("number", minimum=0, maximum=0)  # accepted, but only as the no-op value
    return {
        "model": {"type": "string", "enum": list(models)} if models else _STRING,
        "n": _opt("integer", minimum=1, maximum=1),
        "temperature": _opt("number", minimum=0, maximum=MAX_TEMPERATURE),
        "top_p": _opt("number", exclusiveMinimum=0, maximum=1),
        "top_k": _opt("integer", minimum=-1, maximum=INT64_MAX,
                      description="Extension: keep the k likeliest tokens; 0 or -1 is off."),
        "seed": _opt("integer", minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP,
                            "items": {"type": "string", "minLength": 1}}]},
        "ignore_eos": _opt("boolean", description="Extension: generate past end-of-sequence."),
        "stream": _opt("boolean"),
        "stream_options": _opt("object", properties={"include_usage": _opt("boolean")}),
        "presence_penalty": zero_only,
        "frequency_penalty": zero_only,
        "logit_bias": _opt("object", maxProperties=0),
    }


def _completion_request(models: Sequence[str], vocab_size: int | None) -> Schema:
    token_id: Schema = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    ids: Schema = {"type": "array", "minItems": 1, "items": token_id}
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, ids,
                        {"type": "array", "minItems": 1, "maxItems": 1,
                         "items": {"anyOf": [{"type": "string", "minLength": 1}, ids]}}]}
    return _obj({**_common(models), "prompt": prompt, "max_tokens": _MAX_TOKENS,
                 "logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS),
                 "echo": {"enum": [False, None]},
                 "best_of": _opt("integer", minimum=1, maximum=1),
                 "suffix": _opt("string", maxLength=0)}, ["model", "prompt"])


def _chat_request(models: Sequence[str]) -> Schema:
    part = _obj({"type": {"const": "text"}, "text": _STRING}, ["type", "text"])
    content: Schema = {"anyOf": [_STRING, {"type": "array", "items": part}]}
    others = [r for r in ROLES if r != "assistant"]
    message = {"anyOf": [
        _obj({"role": {"enum": others}, "content": content}, ["role", "content"]),
        # An assistant turn may have null content (OpenAI's tool-call turns).
        _obj({"role": {"const": "assistant"},
              "content": {"anyOf": [*content["anyOf"], {"type": "null"}]}}, ["role"]),
    ]}
    return _obj({**_common(models),
                 "messages": {"type": "array", "minItems": 1, "items": message},
                 "max_tokens": _MAX_TOKENS, "max_completion_tokens": _MAX_TOKENS,
                 "logprobs": _opt("boolean"),
                 "top_logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS),
                 "tools": _opt("array", maxItems=0),
                 "response_format": {"anyOf": [{"type": "null"}, _obj(
                     {"type": {"const": "text"}}, ["type"], additionalProperties=False)]}},
                ["model", "messages"])


def _response(obj: str, choice: Schema) -> Schema:
    return _obj({"id": _STRING, "object": {"const": obj}, "created": _INT, "model": _STRING,
                 "choices": {"type": "array", "items": choice}, "usage": _USAGE},
                ["id", "object", "created", "model", "choices"])


def _post(summary: str, request: Schema, response: Schema) -> Schema:
    def error(description: str) -> Schema:
        return {"description": description,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": "The result; server-sent events when stream is true",
                    "content": {"application/json": {"schema": response},
                                "text/event-stream": {"schema": _STRING}}},
            "400": error("Invalid request"), "404": error("Model not found"),
            "default": error("Any other error (429, 500, 503)"),
        }}}


def _get(summary: str, content: Schema | None = None) -> Schema:
    ok: Schema = {"description": "OK"}
    if content is not None:
        ok["content"] = content
    return {"get": {"summary": summary, "responses": {
        "200": ok, "default": {"description": "Not healthy or not ready (503)"}}}}


def openapi_document(models: Sequence[str], *, vocab_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document for the router's public API; ``vocab_size``, when known, bounds
    prompt token ids."""
    completion_choice = _obj({"index": _INT, "text": _STRING, "logprobs": _opt("object"),
                              "finish_reason": _FINISH}, ["index", "text", "finish_reason"])
    chat_choice = _obj({"index": _INT, "finish_reason": _FINISH, "logprobs": _opt("object"),
                        "message": _obj({"role": {"const": "assistant"},
                                         "content": _opt("string")}, ["role"])},
                       ["index", "message", "finish_reason"])
    model = _obj({"id": _STRING, "object": {"const": "model"}, "created": _INT,
                  "owned_by": _STRING}, ["id", "object", "created", "owned_by"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "Cleave", "version": "v1",
                 "description": "OpenAI-compatible API of the Cleave router."},
        "paths": {
            "/v1/completions": _post("Text completion", _completion_request(models, vocab_size),
                                     _response("text_completion", completion_choice)),
            "/v1/chat/completions": _post("Chat completion", _chat_request(models),
                                          _response("chat.completion", chat_choice)),
            "/v1/models": _get("Served models", {"application/json": {"schema": _obj(
                {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
                ["object", "data"])}}),
            "/health": _get("Liveness"),
            "/ready": _get("Readiness: at least one decode (or both-role) worker is ready"),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": _STRING}}),
        },
        "components": {"schemas": {"Error": _ERROR}},
    }
