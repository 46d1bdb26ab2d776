"""The router's OpenAPI 3.1 document, generated from the request models that validate
(protocol.py, vllm_models.py) and the one error format (wire.ErrorReply).

Schema and validation agree field for field because they are one definition: a fuzzer sends
what the schema allows and expects it served, and what it forbids and expects a 4xx (tests
check it). Two things are added here: the served model names (``model``'s enum), and JSON
null on every optional field (the models drop it before validating: request_types.Body).
Rules no schema can state (at most one structured output, a grammar that compiles, prompt plus
max_tokens within the context, token ids below the vocabulary size when that is not given here)
are the validators' and the engine's, and answer 400 too. The response schemas are written here
(responses.py builds those bodies).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from cleave.runtime.serving import protocol
from cleave.runtime.serving.vllm_models import DetokenizeRequest, TokenizeChat, TokenizePrompt
from cleave.runtime.serving.wire import ErrorReply

Schema = dict[str, Any]
_REF = "#/components/schemas/{model}"
_REQUESTS: tuple[type[BaseModel], ...] = (protocol.COMPLETION, protocol.CHAT, TokenizePrompt,
                                          TokenizeChat, DetokenizeRequest)


class _NoTitles(GenerateJsonSchema):
    """Field titles repeat the field names: left out."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _opt(kind: str, **limits: Any) -> Schema:
    return {"type": [kind, "null"], **limits}


def _obj(properties: Schema, required: Sequence[str] = (), **extra: Any) -> Schema:
    return {"type": "object", "properties": properties, "required": list(required), **extra}


_STRING: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
               # null: the router hides cached_tokens (--prompt-tokens-details hide)
               "prompt_tokens_details": {"anyOf": [{"type": "null"},
                                                   _obj({"cached_tokens": _INT})]}},
              ["prompt_tokens", "completion_tokens", "total_tokens"])
_FINISH: Schema = {"enum": ["stop", "length", "tool_calls"]}
# vLLM's prompt_logprobs, when asked for: null for the first token, then each token's scores by
# token id (logprobs.PromptScores.field).
_PROMPT_LOGPROBS: Schema = {"type": "array", "items": {"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": _obj(
        {"logprob": {"type": "number"}, "rank": _INT, "decoded_token": _STRING},
        ["logprob", "rank", "decoded_token"])}]}}


def _nullable(schema: Schema) -> bool:
    return (not set(schema) - {"default", "description"} or schema.get("type") == "null"
            or {"type": "null"} in schema.get("anyOf", []))


def _objects(defs: Schema) -> Iterator[Schema]:
    yield from (d for d in defs.values() if "properties" in d)


def _with_nulls(defs: Schema) -> None:
    """JSON null means "not given": every optional field of a request takes it."""
    for obj in _objects(defs):
        required = set(obj.get("required", []))
        for name, prop in obj["properties"].items():
            if name not in required and not _nullable(prop):
                outer = {k: prop.pop(k) for k in ("default", "description") if k in prop}
                obj["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


def _served_only(defs: Schema, models: Sequence[str]) -> None:
    for obj in _objects(defs):
        prop = obj["properties"].get("model")
        if prop is not None and models:
            for branch in [prop, *prop.get("anyOf", [])]:
                if branch.get("type") == "string":
                    branch["enum"] = list(models)


def _components(models: Sequence[str], vocab_size: int | None) -> tuple[list[Schema], Schema]:
    """The request bodies' schemas (references) and every named schema they use."""
    refs, top = models_json_schema([(m, "validation") for m in _REQUESTS], ref_template=_REF,
                                   schema_generator=_NoTitles)
    defs: Schema = top["$defs"]
    _served_only(defs, models)
    _with_nulls(defs)
    if vocab_size is not None:
        defs["TokenId"]["maximum"] = vocab_size - 1
    error = ErrorReply.model_json_schema(mode="serialization", ref_template=_REF,
                                         schema_generator=_NoTitles)
    defs.update(error.pop("$defs"))
    defs["Error"] = error
    return [refs[(m, "validation")] for m in _REQUESTS], defs


def _response(obj: str, choice: Schema, **more: Schema) -> Schema:
    return _obj({"id": _STRING, "object": {"const": obj}, "created": _INT, "model": _STRING,
                 "choices": {"type": "array", "items": choice}, "usage": _USAGE, **more},
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


def _vllm_paths(tokenize: Schema, detokenize: Schema) -> Schema:
    """vLLM's own endpoints (vllm_api.py)."""
    ids: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    tokens = _obj({"count": _INT, "max_model_len": _INT, "tokens": ids,
                   "token_strs": {"type": "null"}}, ["count", "max_model_len", "tokens"])
    return {
        "/tokenize": _post("Token ids of a prompt or of chat messages, as generation sees them",
                           tokenize, tokens),
        "/detokenize": _post("Text of token ids", detokenize, _obj({"prompt": _STRING},
                                                                  ["prompt"])),
        "/version": _get("Server version", {"application/json": {"schema": _obj(
            {"version": _STRING}, ["version"])}}),
    }


def openapi_document(models: Sequence[str], *, vocab_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document for the router's public API; ``vocab_size``, when known, bounds
    token ids."""
    (completion, chat, tokenize_prompt, tokenize_chat, detokenize), schemas = _components(
        models, vocab_size)
    completion_choice = _obj({"index": _INT, "text": _STRING, "logprobs": _opt("object"),
                              "finish_reason": _FINISH, "prompt_logprobs": _PROMPT_LOGPROBS},
                             ["index", "text", "finish_reason"])
    chat_choice = _obj({"index": _INT, "finish_reason": _FINISH, "logprobs": _opt("object"),
                        "message": _obj({"role": {"const": "assistant"},
                                         "content": _opt("string"),
                                         "tool_calls": {"type": "array", "items": {
                                             "$ref": _REF.format(model="ToolCall")}}},
                                        ["role"])},
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
            "/v1/completions": _post("Text completion", completion,
                                     _response("text_completion", completion_choice)),
            "/v1/chat/completions": _post("Chat completion", chat, _response(
                "chat.completion", chat_choice, prompt_logprobs=_PROMPT_LOGPROBS)),
            "/v1/models": _get("Served models", {"application/json": {"schema": _obj(
                {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
                ["object", "data"])}}),
            **_vllm_paths({"anyOf": [tokenize_prompt, tokenize_chat]}, detokenize),
            "/health": _get("Liveness"),
            "/ready": _get("Readiness: at least one decode (or both-role) worker is ready"),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": _STRING}}),
        },
        "components": {"schemas": schemas},
    }


@functools.lru_cache(maxsize=8)
def openapi_json(models: tuple[str, ...], vocab_size: int | None = None) -> bytes:
    """The document as ``/openapi.json`` serves it, built once per model list: pydantic's
    schema generation costs ~60 ms of event-loop CPU, and the route needs no key."""
    return json.dumps(openapi_document(models, vocab_size=vocab_size)).encode()
