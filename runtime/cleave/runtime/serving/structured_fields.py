"""Structured-output request fields: OpenAI's ``response_format``, vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``, read into one
llguidance grammar (``SamplingParams.grammar``), checked here so that a bad schema, regex or
grammar is a 400 naming its field before any worker sees it. The engine masks every token
with it (engine/grammar.py).

The values come validated (structured_models.py: their types, one key, not null, all of which
the OpenAPI document states too); what is left here is what no schema says: at most one of
the fields, a bounded size, and a grammar that compiles.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import llguidance

from cleave.runtime.serving.json_fields import JSONObject, bad
from cleave.runtime.serving.structured_models import (
    JSONObjectFormat,
    JSONSchemaFormat,
    StructuredOutputs,
    TextFormat,
)

# Compact separators, as OpenAI's structured outputs print JSON: whitespace between tokens is
# legal JSON but lets a model spend its tokens on it (and a random one does).
_JSON_OPTIONS: Final[Any] = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS: Final = 1 << 16  # a schema or regex beyond this is refused, not compiled
# The request fields, in the order a conflict is reported (the later one is named).
FIELDS: Final = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar")
_ANY_OBJECT: Final[JSONObject] = {"type": "object"}


def _json(schema: JSONObject) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)


def _choice(choices: Sequence[str]) -> str:
    # Lark string literals take JSON's escapes: any choice, quotes and backslashes included.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in choices))


def _grammar(text: str) -> str:
    """Lark's syntax or GBNF (llama.cpp's, which vLLM's xgrammar backend takes): llguidance
    reads both, as vLLM's guidance backend passes them to it (a ValueError for GBNF that does
    not convert, naming the place)."""
    return llguidance.grammar_from("grammar", text)


# By vLLM's guided_* name and structured_outputs' key: the compiler of the value its model
# validated (a schema object, a regex, a list of choices, a grammar, true).
_COMPILERS: Final[dict[str, Callable[[Any], str]]] = {
    "json": _json, "regex": llguidance.LLMatcher.grammar_from_regex, "choice": _choice,
    "grammar": _grammar, "json_object": lambda _: _json(_ANY_OBJECT)}


def _source(name: str, value: object) -> tuple[str, str, object]:
    """The field's (param named in errors, compiler, value to compile)."""
    if isinstance(value, StructuredOutputs):
        key, inner = value.asked()
        return f"{name}.{key}", key, inner
    if isinstance(value, JSONObjectFormat):
        return name, "json_object", True
    if isinstance(value, JSONSchemaFormat):
        return f"{name}.json_schema.schema", "json", value.json_schema.json_schema
    return name, name.removeprefix("guided_"), value


def grammar(fields: Mapping[str, object]) -> str | None:
    """The request's grammar (llguidance's text), None when it asks for none. ``fields``: the
    structured-output fields (FIELDS) as the request model validated them, None or absent
    where not given. At most one may ask, and what it asks must compile."""
    asked = [name for name in FIELDS if fields.get(name) is not None
             and not isinstance(fields[name], TextFormat)]
    if len(asked) > 1:
        raise bad(asked[1], f"'{asked[0]}' and '{asked[1]}' cannot be combined")
    if not asked:
        return None
    param, kind, value = _source(asked[0], fields[asked[0]])
    if len(json.dumps(value)) > MAX_GRAMMAR_CHARS:
        raise bad(param, f"'{param}' is longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        text = _COMPILERS[kind](value)
    except ValueError as e:
        raise bad(param, f"'{param}' is not valid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise bad(param, f"'{param}' is not a valid structured output: {error.strip()}")
    return text
