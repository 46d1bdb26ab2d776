"""Every body the router sends, held to two definitions it must agree with: the response schema
of its own OpenAPI document (generated from response_models.py: fields, types, required and
no others) and the official ``openai`` client's types (strict validation), streamed events one
by one.

``checked_client`` is an ``openai`` client whose every response is checked as it arrives (an
httpx response hook); ``checked_post`` is serving_stack.post_raw, checked. A body that does
not match fails the test that got it: the hook's AssertionError reaches the test wrapped in the
client's ``APIConnectionError`` (its cause), ``checked_post``'s directly.
"""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from typing import Any

import httpx2
import jsonschema
import openai
import pydantic
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from cleave.runtime.serving.openapi import openapi_document

Checked = Counter[str]  # what was checked: "<path> <status> <content type>"
CHECKED: Checked = Counter()  # over the whole session (tests assert they added to it)


@functools.cache
def _document() -> dict[str, Any]:
    return openapi_document(["tiny"])


def _validate(schema: dict[str, Any], value: object, where: str) -> None:
    validator = jsonschema.Draft202012Validator(
        {**schema, "components": _document()["components"]})
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(value)]
    assert not errors, f"{where}: the document's schema refuses {value!r}: {errors}"


# vLLM's fields beyond OpenAI's, by the client's type that carries them
VLLM_EXTRAS: dict[str, set[str]] = {"Model": {"root", "parent", "max_model_len"},
                                    "CompletionChoice": {"prompt_logprobs"},
                                    "ChatCompletion": {"prompt_logprobs"}}


def _known(value: object) -> None:
    """Every field is one the client's type names (its models keep unknown ones as extras)."""
    if isinstance(value, pydantic.BaseModel):
        kind = type(value).__name__
        extra = set(value.model_extra or ()) - VLLM_EXTRAS.get(kind, set())
        assert not extra, f"fields that OpenAI's {kind} does not have: {extra}"
        for name in type(value).model_fields:
            _known(getattr(value, name))
    elif isinstance(value, list):
        for item in value:
            _known(item)


def _as_typed(choice: dict[str, Any]) -> dict[str, Any]:
    """Where OpenAI's own API sends null and the client's types say it cannot: a streamed
    choice's finish_reason until its last chunk, and an echoed prompt's first token's logprob
    (nothing comes before it). Read as a value there, so everything else is checked strictly."""
    out = {**choice, "finish_reason": choice["finish_reason"] or "length"}
    lps = choice["logprobs"]
    if lps is not None:
        out["logprobs"] = {**lps, "token_logprobs": [x or 0.0 for x in lps["token_logprobs"]],
                           "top_logprobs": [x or {} for x in lps["top_logprobs"]]}
    return out


def _openai_types(path: str, status: int, body: Any, chunk: bool) -> None:
    """The client's own models, strictly (no coercion), and no field they do not name."""
    parsed: list[pydantic.BaseModel] = []
    if "error" in body:
        parsed.append(ErrorObject.model_validate(body["error"], strict=True))
    elif status != 200:
        return  # /ready's 503 {"status": ...}: no OpenAI type
    elif path == "/v1/chat/completions":
        kind = ChatCompletionChunk if chunk else ChatCompletion
        parsed.append(kind.model_validate(body, strict=True))
    elif path == "/v1/completions":
        choices = [_as_typed(c) for c in body["choices"]]
        parsed.append(Completion.model_validate({**body, "choices": choices}, strict=True))
    elif path == "/v1/models":
        parsed += [Model.model_validate(entry, strict=True) for entry in body["data"]]
    _known(parsed)


def _events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n"), raw[-200:]
    frames = raw[:-2].split(b"\n\n")
    assert all(f.startswith(b"data: ") and b"\n" not in f for f in frames), frames
    return [f[len(b"data: "):].decode() for f in frames]


def check_reply(method: str, path: str, status: int, content_type: str, raw: bytes) -> None:
    """One response of the router, as it came over the wire."""
    answers = _document()["paths"][path][method.lower()]["responses"]
    media_type = content_type.split(";")[0].strip()
    media = (answers.get(str(status)) or answers["default"])["content"][media_type]
    where = f"{method} {path} -> {status} {media_type}"
    if media_type == "text/event-stream":
        *data, done = _events(raw)
        assert done == "[DONE]" and data, where
        for event in data:
            body = json.loads(event)
            _validate(media["x-sse-data"], body, where)
            _openai_types(path, status, body, chunk=True)
    else:
        body = json.loads(raw)
        _validate(media["schema"], body, where)
        _openai_types(path, status, body, chunk=False)
    CHECKED[f"{path} {status} {media_type}"] += 1


def _hook(response: httpx2.Response) -> None:
    response.read()  # the whole body (a stream too): the client then reads it from memory
    check_reply(response.request.method, response.request.url.path, response.status_code,
                response.headers.get("content-type", ""), response.content)


def checked_client(base_url: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx2.Client(event_hooks={"response": [_hook]}),
                         **options)


def checked_post(url: str, body: bytes) -> tuple[int, Any]:
    """POST ``body`` (a path under the router's root); the status and the parsed reply."""
    request = urllib.request.Request(url, data=body, method="POST",
                                      headers={"Content-Type": "application/json"})
    return _checked("POST", request)


def checked_get(url: str) -> tuple[int, Any]:
    return _checked("GET", urllib.request.Request(url))


def _checked(method: str, request: urllib.request.Request) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, content_type, raw = r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        status, content_type, raw = e.code, e.headers["Content-Type"], e.read()
    path = urllib.parse.urlsplit(request.full_url).path
    check_reply(method, path, status, content_type, raw)
    return status, json.loads(raw)
