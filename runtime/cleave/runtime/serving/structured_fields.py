"""Structured-output request fields: OpenAI's ``response_format``, vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``, read into one
llguidance grammar (``SamplingParams.grammar``), checked here so that a bad schema, regex or
grammar is a 400 naming its field before any worker sees it. The engine masks every token
with it (engine/grammar.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import llguidance

from cleave.runtime.serving.json_fields import bad

# Compact separators, as OpenAI's structured outputs print JSON: whitespace between tokens is
# legal JSON but lets a model spend its tokens on it (and a random one does).
_JSON_OPTIONS: Final[Any] = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS: Final = 1 << 16  # a schema or regex beyond this is refused, not compiled
# vLLM's structured_outputs object: its keys, and the guided_* field each means.
_STRUCTURED_KEYS: Final = {"json": "guided_json", "regex": "guided_regex",
                           "choice": "guided_choice", "grammar": "guided_grammar",
                           "json_object": "json_object"}


def _schema(value: object, param: str) -> str:
    if isinstance(value, str):  # vLLM takes the schema as a JSON string too
        try:
            value = json.loads(value)
        except ValueError:
            raise bad(param, f"'{param}' must be a JSON schema (an object)") from None
    if not isinstance(value, dict):
        raise bad(param, f"'{param}' must be a JSON schema (an object)")
    return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=_JSON_OPTIONS)


def _regex(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(param, f"'{param}' must be a non-empty regular expression")
    return llguidance.LLMatcher.grammar_from_regex(value)


def _choice(value: object, param: str) -> str:
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise bad(param, f"'{param}' must be a non-empty list of non-empty strings")
    # Lark string literals take JSON's escapes: any choice, quotes and backslashes included.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in value))


def _grammar(value: object, param: str) -> str:
    """Lark's syntax or GBNF (llama.cpp's, which vLLM's xgrammar backend takes): llguidance
    reads both, as vLLM's guidance backend passes them to it."""
    if not isinstance(value, str) or not value:
        raise bad(param, f"'{param}' must be a non-empty grammar (Lark or GBNF)")
    try:
        return llguidance.grammar_from("grammar", value)
    except ValueError as e:  # GBNF that does not convert: its error names the place
        raise bad(param, f"'{param}' is not a valid grammar: {e}") from None


def _response_format(value: object) -> str | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema({"type": "object"}, param)
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)
                and isinstance(spec.get("name", ""), str)):
            raise bad(param, "'response_format.json_schema' must have a 'schema' (a JSON "
                      "schema) and may have a 'name' (a string)")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise bad(param, "'response_format.type' must be 'text', 'json_object' or 'json_schema'")


def _structured_outputs(value: object) -> tuple[str, object]:
    param = "structured_outputs"
    given = dict(value) if isinstance(value, dict) else None
    if given is None or len(given) != 1 or next(iter(given)) not in _STRUCTURED_KEYS:
        raise bad(param, f"'{param}' must be an object with one of "
                  f"{', '.join(_STRUCTURED_KEYS)}")
    [(key, v)] = given.items()
    if key == "json_object":
        if v is not True:
            raise bad(param, f"'{param}.json_object' must be true")
        return "response_format", {"type": "json_object"}
    return _STRUCTURED_KEYS[key], v


_READERS: Final = {"guided_json": _schema, "guided_regex": _regex, "guided_choice": _choice,
                   "guided_grammar": _grammar}


def grammar(body: Mapping[str, object]) -> str | None:
    """The request's grammar (llguidance's text), None when it asks for none; at most one of
    the fields may ask, and what it asks must compile."""
    asked = [name for name in ("response_format", "structured_outputs", *_READERS)
             if body.get(name) is not None and body.get(name) != {"type": "text"}]
    if len(asked) > 1:
        raise bad(asked[1], f"'{asked[0]}' and '{asked[1]}' cannot be combined")
    if not asked:
        return None
    name, value = asked[0], body[asked[0]]
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise bad(name, f"'{name}' is longer than {MAX_GRAMMAR_CHARS} characters")
    kind = name
    if name == "structured_outputs":
        kind, value = _structured_outputs(value)
    text = _response_format(value) if kind == "response_format" else _READERS[kind](value, name)
    if text is not None:
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise bad(name, f"'{name}' is not a valid structured output: {error.strip()}")
    return text
