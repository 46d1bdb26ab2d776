"""The structured-output request fields as pydantic models: OpenAI's ``response_format`` and
vLLM's ``guided_*`` and ``structured_outputs``. What they state (types, one key, not null) the
OpenAPI document states too (openapi.py generates it from them); structured_fields.py compiles
the validated values into the grammar, and checks what no schema can say.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, RootModel, Strict, Tag

from cleave.runtime.serving.json_fields import JSONObject
from cleave.runtime.serving.request_types import Body, Loose, Refusal, Text, fail

# -- OpenAI's response_format ----------------------------------------------------------------

class JSONSchemaSpec(Loose):
    name: Text = ""
    json_schema: JSONObject = Field(alias="schema")


class TextFormat(Loose):
    type: Literal["text"]


class JSONObjectFormat(Loose):
    type: Literal["json_object"]


class JSONSchemaFormat(Loose):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat,
    Refusal("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
            '{"type": "json_schema", "json_schema": {"schema": <a JSON schema>, '
            '"name": <string>}}')]


# -- vLLM's guided_* and structured_outputs --------------------------------------------------

def _json_text(v: object) -> object:
    """vLLM takes the schema as its JSON text too: read here, so that the model holds the
    object (the object check follows)."""
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except ValueError:
        raise fail("{param} must be a JSON schema (an object), or its JSON text") from None


GuidedJSON = Annotated[
    JSONObject, BeforeValidator(_json_text, json_schema_input_type=JSONObject | str),
    Refusal("'guided_json' must be a JSON schema (an object), or its JSON text"),
    Field(description="Extension (vLLM's): a JSON schema, or its JSON text.")]
GuidedRegex = Annotated[str, Strict(), Field(min_length=1, description="Extension (vLLM's).")]
GuidedGrammar = Annotated[str, Strict(), Field(
    min_length=1, description="Extension (vLLM's): a grammar in Lark's syntax or GBNF "
    "(llguidance's dialects: docs/architecture.md, Structured outputs).")]
GuidedChoice = Annotated[
    list[Annotated[str, Strict(), Field(min_length=1)]],
    Field(min_length=1, description="Extension (vLLM's): the output is one of these."),
    Refusal("'guided_choice' must be a non-empty list of non-empty strings")]


class OneOutput(Body):
    """One of vLLM's ``structured_outputs`` keys: each a model with that one required field,
    so that the schema (an object with one required property, which takes no null, and no
    other) and the validation say the same "exactly one key, not null"."""

    @classmethod
    def key(cls) -> str:
        [(name, field)] = cls.model_fields.items()
        return field.alias or name


def _true(v: object) -> object:
    """JSON's true only: pydantic's Literal[True] takes 1 too, the document's const does not."""
    if v is not True:
        raise fail("{param} must be true")
    return v


class StructuredJSON(OneOutput):
    json_: GuidedJSON = Field(alias="json")


class StructuredRegex(OneOutput):
    regex: GuidedRegex


class StructuredChoice(OneOutput):
    choice: GuidedChoice


class StructuredGrammar(OneOutput):
    grammar: GuidedGrammar


class StructuredJSONObject(OneOutput):
    json_object: Annotated[Literal[True], BeforeValidator(_true)]


OUTPUT_KEYS: Final = tuple(m.key() for m in (StructuredJSON, StructuredRegex, StructuredChoice,
                                             StructuredGrammar, StructuredJSONObject))


def _tag(model: type[OneOutput]) -> Tag:
    return Tag(f"<{model.key()}>")  # <...>: request_types.param_of leaves it out


def _output_tag(v: Any) -> str | None:
    """The one key's tag; None (the error below) for more keys, none, or a null one."""
    if isinstance(v, OneOutput):  # serializing
        return f"<{v.key()}>"
    if isinstance(v, dict) and len(v) == 1:
        [(key, value)] = v.items()
        if key in OUTPUT_KEYS and value is not None:
            return f"<{key}>"
    return None


_OneOf = Annotated[
    Annotated[StructuredJSON, _tag(StructuredJSON)]
    | Annotated[StructuredRegex, _tag(StructuredRegex)]
    | Annotated[StructuredChoice, _tag(StructuredChoice)]
    | Annotated[StructuredGrammar, _tag(StructuredGrammar)]
    | Annotated[StructuredJSONObject, _tag(StructuredJSONObject)],
    Discriminator(_output_tag, custom_error_type="cleave", custom_error_message="{message}",
                  custom_error_context={
                      "message": "{param} must be an object with exactly one of "
                      f"{', '.join(OUTPUT_KEYS)}, not null", "param": None, "sub": ""})]


# A class, not the annotated union itself: the Discriminator's error context (a dict) cannot
# be hashed into the request's ``StructuredOutputs | None``.
class StructuredOutputs(RootModel[_OneOf]):
    """vLLM's structured_outputs: exactly one of its keys, not null."""
    model_config = ConfigDict(frozen=True)

    def asked(self) -> tuple[str, object]:
        """The key and its validated value."""
        [name] = type(self.root).model_fields
        return self.root.key(), getattr(self.root, name)
