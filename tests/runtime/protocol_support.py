"""Shared by the protocol tests: request bodies, the tables of bodies that must be refused, and
the OpenAPI document's request schemas."""

from __future__ import annotations

import functools
import math
from typing import Any

import jsonschema

from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.openapi import openapi_document

MODEL = "smollm2"
SERVED = [MODEL]
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, **fields}


def request_schema(path: str) -> dict[str, Any]:
    """The request body's schema of ``path`` in the document served for :data:`SERVED`, with
    the components it refers to (a schema on its own)."""
    doc = openapi_document(SERVED)
    schema: dict[str, Any] = doc["paths"][path]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    return {**schema, "components": doc["components"]}


@functools.cache
def request_validator(path: str) -> jsonschema.Draft202012Validator:
    """A validator of :func:`request_schema` (built once: the fuzz tests call it per case)."""
    return jsonschema.Draft202012Validator(request_schema(path))


# -- validation: bad bodies -----------------------------------------------------------------

COMMON_BAD: list[tuple[dict[str, Any], str | None]] = [
    ({"n": 129}, "n"), ({"n": 0}, "n"), ({"n": "1"}, "n"), ({"n": True}, "n"),
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
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": False}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
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
    ({"echo": 1}, "echo"), ({"best_of": 0}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"best_of": 129}, "best_of"),
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
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": {"type": "function"}}, "tools"), ({"tool_choice": "any"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
]
