"""The router's OpenAPI 3.1 document, describing what ``protocol.py`` accepts and returns.

Schema and validation must agree field for field: a fuzzer (schemathesis) sends what the schema
allows and expects it served, and what it forbids and expects a 4xx. Rules no schema can state
(prompt plus max_tokens within the context, token ids below the vocabulary size when that is not
given here) are the engine's, and answer 400 too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cleave.runtime.engine.sequence import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID_LIST,
)
from cleave.runtime.serving import request_fields as fields
from cleave.runtime.serving.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_CHOICES,
    MAX_STOP,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    ROLES,
)
from cleave.runtime.serving.tools import MAX_TOOLS

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
               # null: the router hides cached_tokens (--prompt-tokens-details hide)
               "prompt_tokens_details": {"anyOf": [{"type": "null"},
                                                   _obj({"cached_tokens": _INT})]}},
              ["prompt_tokens", "completion_tokens", "total_tokens"])
_FINISH: Schema = {"enum": ["stop", "length", "tool_calls"]}


def _sampling() -> Schema:
    """Penalties, logit bias and vLLM's sampling extensions (sampling_fields.py)."""
    penalty = _opt("number", minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    return {
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "logit_bias": _opt("object", maxProperties=MAX_TOKEN_ID_LIST,
                           propertyNames={"pattern": "^[0-9]+$"},
                           additionalProperties={"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                 "maximum": MAX_LOGIT_BIAS}),
        "repetition_penalty": _opt("number", exclusiveMinimum=0,
                                   maximum=MAX_REPETITION_PENALTY,
                                   description="Extension (vLLM's): over prompt and output."),
        "min_p": _opt("number", minimum=0, maximum=1, description="Extension (vLLM's)."),
        "min_tokens": _opt("integer", minimum=0, maximum=MAX_TOKENS_LIMIT,
                           description="Extension (vLLM's): at most max_tokens."),
        "stop_token_ids": _opt("array", maxItems=MAX_TOKEN_ID_LIST,
                               items={"type": "integer", "minimum": 0},
                               description="Extension (vLLM's)."),
        **_structured(),
    }


def _structured() -> Schema:
    """Structured outputs (structured_fields.py): at most one of these per request, and a
    schema or regex that compiles (both checked there, answering 400 naming the field)."""
    schema: Schema = {"type": "object"}
    json_spec = _obj({"name": _STRING, "schema": schema}, ["schema"])
    response_format = {"anyOf": [{"type": "null"}, *(
        _obj({"type": {"const": kind}, **extra}, ["type", *extra])
        for kind, extra in (("text", {}), ("json_object", {}),
                            ("json_schema", {"json_schema": json_spec})))]}
    guided_json = {"anyOf": [{"type": "null"}, schema, _STRING],
                   "description": "Extension (vLLM's): a JSON schema, or its JSON text."}
    regex = _opt("string", minLength=1, description="Extension (vLLM's).")
    choice = _opt("array", minItems=1, items={"type": "string", "minLength": 1},
                  description="Extension (vLLM's): the output is one of these.")
    return {
        "response_format": response_format, "guided_json": guided_json, "guided_regex": regex,
        "guided_choice": choice,
        "structured_outputs": _opt("object", minProperties=1, maxProperties=1,
                                   additionalProperties=False, properties={
                                       "json": guided_json, "regex": regex, "choice": choice,
                                       "json_object": {"const": True}},
                                   description="Extension (vLLM's): one of its keys."),
    }


def _tool_fields() -> Schema:
    """Tool calling (tools.py): function tools and the choice of call, as far as a schema can
    state them."""
    name: Schema = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    function = _obj({"name": name, "description": _STRING, "parameters": {"type": "object"},
                     "strict": _opt("boolean", description="Only with 'required' or a named "
                                    "tool_choice (the grammar holds it).")},
                    ["name"], additionalProperties=False)
    tool = _obj({"type": {"const": "function"}, "function": function}, ["type", "function"],
                additionalProperties=False)
    named = _obj({"type": {"const": "function"}, "function": _obj({"name": name}, ["name"])},
                 ["type", "function"])
    return {
        "tools": _opt("array", maxItems=MAX_TOOLS, items=tool,
                      description="Function names must differ."),
        "tool_choice": {"anyOf": [{"type": "null"}, {"enum": ["none", "auto", "required"]},
                                  named],
                        "description": "A named function must be in tools."},
        "parallel_tool_calls": _opt("boolean"),
    }


def _tool_calls() -> Schema:
    """An assistant message's calls, as requests send them back and responses return them."""
    call = _obj({"id": _STRING, "type": {"const": "function"},
                 "function": _obj({"name": _STRING, "arguments": _STRING},
                                  ["name", "arguments"])}, ["function"])
    return {"type": "array", "items": call}


def _common(models: Sequence[str]) -> Schema:
    return {
        "model": {"type": "string", "enum": list(models)} if models else _STRING,
        "n": _opt("integer", minimum=1, maximum=MAX_CHOICES),
        "temperature": _opt("number", minimum=0, maximum=MAX_TEMPERATURE),
        "top_p": _opt("number", exclusiveMinimum=0, maximum=1),
        "top_k": _opt("integer", minimum=-1, maximum=INT64_MAX,
                      description="Extension: keep the k likeliest tokens; 0 or -1 is off."),
        "seed": _opt("integer", minimum=INT64_MIN, maximum=INT64_MAX),
        "stop": {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP,
                            "items": {"type": "string", "minLength": 1}}]},
        "ignore_eos": _opt("boolean", description="Extension: generate past end-of-sequence."),
        "cache_salt": _opt("string", minLength=1, maxLength=MAX_CACHE_SALT_CHARS,
                           description="vLLM's extension: only requests with the same salt "
                                       "share cached KV blocks."),
        "stream": _opt("boolean"),
        "stream_options": _opt("object", properties={"include_usage": _opt("boolean")}),
        **_sampling(),
    }


def _extensions(no_ops: Mapping[str, tuple[object, ...]]) -> Schema:
    """Fields accepted at no-op values only (request_fields.py), and those ignored whatever
    their value; with ``additionalProperties: false``, any other field is refused, as there."""
    ignored: Schema = {name: {} for name in sorted(fields.IGNORED)}
    return {**ignored, **{name: {"enum": [None, *values]} if values else {"type": "null"}
                          for name, values in no_ops.items()}}


def _completion_request(models: Sequence[str], vocab_size: int | None) -> Schema:
    token_id: Schema = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    ids: Schema = {"type": "array", "minItems": 1, "items": token_id}
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, ids,
                        {"type": "array", "minItems": 1, "maxItems": 1,
                         "items": {"anyOf": [{"type": "string", "minLength": 1}, ids]}}]}
    return _obj({**_extensions(fields.COMPLETION_NO_OPS), **_common(models), "prompt": prompt,
                 "max_tokens": _MAX_TOKENS,
                 "logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS),
                 "echo": _opt("boolean", description="Not with logprobs (no prompt logprobs)."),
                 "best_of": _opt("integer", minimum=1, maximum=MAX_CHOICES,
                                 description="At least n; greater than n only unstreamed."),
                 "suffix": _opt("string", maxLength=0)}, ["model", "prompt"],
                additionalProperties=False)


def _chat_request(models: Sequence[str]) -> Schema:
    part = _obj({"type": {"const": "text"}, "text": _STRING}, ["type", "text"])
    content: Schema = {"anyOf": [_STRING, {"type": "array", "items": part}]}
    others = [r for r in ROLES if r not in ("assistant", "tool")]
    message = {"anyOf": [
        _obj({"role": {"enum": others}, "content": content, "tool_calls": {"type": "null"}},
             ["role", "content"]),
        _obj({"role": {"const": "tool"}, "content": content, "tool_call_id": _opt("string"),
              "tool_calls": {"type": "null"}}, ["role", "content"]),
        # An assistant turn may have null content (OpenAI's tool-call turns).
        _obj({"role": {"const": "assistant"},
              "content": {"anyOf": [*content["anyOf"], {"type": "null"}]},
              "tool_calls": {"anyOf": [{"type": "null"}, _tool_calls()]}}, ["role"]),
    ]}
    return _obj({**_extensions(fields.CHAT_NO_OPS), **_common(models),
                 "messages": {"type": "array", "minItems": 1, "items": message},
                 "max_tokens": _MAX_TOKENS, "max_completion_tokens": _MAX_TOKENS,
                 "logprobs": _opt("boolean"),
                 "top_logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS),
                 **_tool_fields()},
                ["model", "messages"], additionalProperties=False)


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


def _vllm_paths(models: Sequence[str]) -> Schema:
    """vLLM's own endpoints (vllm_api.py)."""
    model = {"anyOf": [{"type": "null"}, _common(models)["model"]]}  # optional, as in vLLM
    ids: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    text = _completion_request(models, None)["properties"]["prompt"]
    messages = _chat_request(models)["properties"]["messages"]
    special = _opt("boolean", description="Default: true with prompt, false with messages.")
    tokenize = {"anyOf": [
        _obj({"model": model, "prompt": text, "add_special_tokens": special}, ["prompt"]),
        _obj({"model": model, "messages": messages, "add_special_tokens": special},
             ["messages"])]}
    tokens = _obj({"count": _INT, "max_model_len": _INT, "tokens": ids,
                   "token_strs": {"type": "null"}}, ["count", "max_model_len", "tokens"])
    return {
        "/tokenize": _post("Token ids of a prompt or of chat messages, as generation sees them",
                           tokenize, tokens),
        "/detokenize": _post("Text of token ids", _obj({"model": model, "tokens": ids},
                                                         ["tokens"]),
                             _obj({"prompt": _STRING}, ["prompt"])),
        "/version": _get("Server version", {"application/json": {"schema": _obj(
            {"version": _STRING}, ["version"])}}),
    }


def openapi_document(models: Sequence[str], *, vocab_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document for the router's public API; ``vocab_size``, when known, bounds
    prompt token ids."""
    completion_choice = _obj({"index": _INT, "text": _STRING, "logprobs": _opt("object"),
                              "finish_reason": _FINISH}, ["index", "text", "finish_reason"])
    chat_choice = _obj({"index": _INT, "finish_reason": _FINISH, "logprobs": _opt("object"),
                        "message": _obj({"role": {"const": "assistant"},
                                         "content": _opt("string"),
                                         "tool_calls": _tool_calls()}, ["role"])},
                       ["index", "message", "finish_reason"])
    model = _obj({"id": _STRING, "object": {"const": "model"}, "created": _INT,
                  "owned_by": _STRING, "root": _STRING, "parent": _opt("string"),
                  "max_model_len": _INT},
                 ["id", "object", "created", "owned_by", "root", "max_model_len"])
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
            **_vllm_paths(models),
            "/health": _get("Liveness"),
            "/ready": _get("Readiness: at least one decode (or both-role) worker is ready"),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": _STRING}}),
        },
        "components": {"schemas": {"Error": _ERROR}},
    }
