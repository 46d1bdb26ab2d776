"""The router's OpenAPI 3.1 document, generated from the models that validate its requests
(protocol.py, vllm_models.py) and build its responses (response_models.py, and wire.ErrorReply,
the one error format).

Schema and validation agree field for field because they are one definition: a fuzzer sends
what the schema allows and expects it served, and what it forbids and expects a 4xx (tests
check it); every body the router sends validates against its response schema (tests check that
too). Two things are added to the requests here: the served model names (``model``'s enum), and
JSON null on every optional field (the models drop it before validating: request_types.Body).
Rules no schema can state (at most one structured output, a grammar that compiles, guided_json's
text a JSON object, prompt plus max_tokens within the context, token ids below the vocabulary
size when that is not given here) are the validators' and the engine's, and answer 400 too.
(structured_outputs is an object with exactly one non-null key: its models state that with
required properties, which take no null.) A streamed response is a string to
OpenAPI 3.1; ``x-sse-data`` on its media type names the schema of each event's data.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from cleave.runtime.serving import protocol
from cleave.runtime.serving import response_models as rm
from cleave.runtime.serving.vllm_models import DetokenizeRequest, TokenizeChat, TokenizePrompt
from cleave.runtime.serving.wire import ErrorReply

Schema = dict[str, Any]
_REF = "#/components/schemas/{model}"
_REQUESTS: tuple[type[BaseModel], ...] = (protocol.COMPLETION, protocol.CHAT, TokenizePrompt,
                                          TokenizeChat, DetokenizeRequest)
_RESPONSES: tuple[type[BaseModel], ...] = (
    rm.Completion, rm.ChatCompletion, rm.CompletionChunk, rm.ChatCompletionChunk, rm.ModelList,
    rm.TokenizeResponse, rm.DetokenizeResponse, rm.VersionResponse, rm.StatusResponse)
_ERROR: Schema = {"$ref": _REF.format(model="Error")}


class _NoTitles(GenerateJsonSchema):
    """Field titles repeat the field names: left out."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _ref(model: type[BaseModel]) -> Schema:
    return {"$ref": _REF.format(model=model.__name__)}


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


def _merge(defs: Schema, more: Schema) -> None:
    for name, schema in more.items():
        if defs.setdefault(name, schema) != schema:  # a request's and a response's
            raise ValueError(f"two different schemas are named {name}")


def _components(models: Sequence[str], vocab_size: int | None) -> tuple[list[Schema], Schema]:
    """The request bodies' schemas (references) and every named schema the document uses."""
    refs, top = models_json_schema([(m, "validation") for m in _REQUESTS], ref_template=_REF,
                                   schema_generator=_NoTitles)
    defs: Schema = top["$defs"]
    _served_only(defs, models)
    _with_nulls(defs)
    if vocab_size is not None:
        defs["TokenId"]["maximum"] = vocab_size - 1
    _, answers = models_json_schema([(m, "serialization") for m in _RESPONSES],
                                    ref_template=_REF, schema_generator=_NoTitles)
    _merge(defs, answers["$defs"])
    error = ErrorReply.model_json_schema(mode="serialization", ref_template=_REF,
                                         schema_generator=_NoTitles)
    _merge(defs, {**error.pop("$defs"), "Error": error})
    return [refs[(m, "validation")] for m in _REQUESTS], defs


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _post(summary: str, request: Schema, response: type[BaseModel],
          chunk: type[BaseModel] | None = None) -> Schema:
    def error(description: str) -> Schema:
        return {"description": description, "content": _json(_ERROR)}

    content = _json(_ref(response))
    if chunk is not None:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": (
                f"When stream is true: server-sent events, `data: <{chunk.__name__}>` each "
                "(or one Error, should the stream fail once started), then `data: [DONE]`")},
            "x-sse-data": {"anyOf": [_ref(chunk), _ERROR]}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "The result", "content": content},
            "400": error("Invalid request"), "404": error("Model not found"),
            "default": error("Any other error (401, 429, 500, 503)"),
        }}}


def _get(summary: str, ok: Schema, default: Schema | None = None) -> Schema:
    other = default or {"description": "Any error (401)", "content": _json(_ERROR)}
    return {"get": {"summary": summary, "responses": {"200": ok, "default": other}}}


def _status(summary: str, failing: str) -> Schema:
    status = _json(_ref(rm.StatusResponse))
    return _get(summary, {"description": "OK", "content": status},
                {"description": failing, "content": status})


def openapi_document(models: Sequence[str], *, vocab_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document for the router's public API; ``vocab_size``, when known, bounds
    token ids."""
    (completion, chat, tokenize_prompt, tokenize_chat, detokenize), schemas = _components(
        models, vocab_size)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Cleave", "version": "v1",
                 "description": "OpenAI-compatible API of the Cleave router."},
        "paths": {
            "/v1/completions": _post("Text completion", completion, rm.Completion,
                                     rm.CompletionChunk),
            "/v1/chat/completions": _post("Chat completion", chat, rm.ChatCompletion,
                                          rm.ChatCompletionChunk),
            "/v1/models": _get("Served models", {"description": "OK",
                                                 "content": _json(_ref(rm.ModelList))}),
            # vLLM's own endpoints (vllm_api.py)
            "/tokenize": _post("Token ids of a prompt or of chat messages, as generation sees "
                               "them", {"anyOf": [tokenize_prompt, tokenize_chat]},
                               rm.TokenizeResponse),
            "/detokenize": _post("Text of token ids", detokenize, rm.DetokenizeResponse),
            "/version": _get("Server version", {"description": "OK",
                                                "content": _json(_ref(rm.VersionResponse))}),
            "/health": _status("Liveness", "Not alive"),
            "/ready": _status("Readiness: at least one decode (or both-role) worker is ready",
                              "Not ready (503)"),
            "/metrics": _get("Prometheus metrics", {"description": "OK", "content": {
                "text/plain": {"schema": {"type": "string"}}}}),
        },
        "components": {"schemas": schemas},
    }


@functools.lru_cache(maxsize=8)
def openapi_json(models: tuple[str, ...], vocab_size: int | None = None) -> bytes:
    """The document as ``/openapi.json`` serves it, built once per model list: pydantic's
    schema generation costs ~60 ms of event-loop CPU, and the route needs no key."""
    return json.dumps(openapi_document(models, vocab_size=vocab_size)).encode()
