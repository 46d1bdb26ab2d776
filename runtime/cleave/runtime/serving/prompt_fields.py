"""Request field types with rules of their own: the completion prompt's forms, stop
sequences, the token ids a request names (and checks them), and the fields accepted only at
no-op values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    PlainValidator,
    Strict,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    create_model,
)

from cleave.runtime.engine.sequence import MAX_LOGIT_BIAS, MAX_TOKEN_ID_LIST, SamplingParams
from cleave.runtime.serving import request_fields
from cleave.runtime.serving.json_fields import bad
from cleave.runtime.serving.request_types import Number, Refusal, TokenId, fail

MAX_STOP: Final = 4  # OpenAI's limit on stop sequences
# Each stop string's length: far beyond any real one, and what keeps checking the output
# against them cheap (the router and every worker refuse longer ones).
MAX_STOP_CHARS: Final = 1024
Model = TypeVar("Model", bound=BaseModel)

# -- prompt ----------------------------------------------------------------------------------

NonEmpty = Annotated[str, Strict(), Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# What a client may send: text, token ids, or a batch of one of them (as clients that always
# batch send it).
PromptInput = NonEmpty | TokenIds | Annotated[list[NonEmpty | TokenIds],
                                              Field(min_length=1, max_length=1)]
_IDS: Final = TypeAdapter(TokenIds)


def _prompt(v: object) -> str | tuple[int, ...]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if v == "" or v == []:
        raise fail("{param} must not be empty")
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if any(isinstance(t, (str, list)) for t in v):
            raise fail("batched prompts are not supported; send one per request")
        try:
            return tuple(_IDS.validate_python(v))
        except ValidationError:
            pass
    raise fail("{param} must be a string, a list of token ids (integers >= 0), or a list "
               "holding one of those")


Prompt = Annotated[str | tuple[int, ...],
                   PlainValidator(_prompt, json_schema_input_type=PromptInput)]

# -- stop ------------------------------------------------------------------------------------

StopText = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _one_or_many(v: object) -> object:
    return [v] if isinstance(v, str) else v


Stop = Annotated[
    tuple[StopText, ...], Field(max_length=MAX_STOP),
    BeforeValidator(_one_or_many, json_schema_input_type=StopText | Annotated[
        list[StopText], Field(max_length=MAX_STOP)]),
    Refusal(f"'stop' must be a non-empty string of at most {MAX_STOP_CHARS} characters, or "
            f"up to {MAX_STOP} of them")]


# -- token ids -------------------------------------------------------------------------------

LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
         Annotated[Number, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    # Keys that are not token ids are refused: pydantic states the pattern, this the refusal.
    Field(max_length=MAX_TOKEN_ID_LIST, json_schema_extra={"additionalProperties": False}),
    Refusal(f"'logit_bias' must map token ids (as strings) to biases in [-{MAX_LOGIT_BIAS}, "
            f"{MAX_LOGIT_BIAS}], at most {MAX_TOKEN_ID_LIST} of them")]
StopTokenIds = Annotated[
    tuple[TokenId, ...],
    Field(max_length=MAX_TOKEN_ID_LIST, description="Extension (vLLM's)."),
    Refusal(f"'stop_token_ids' must be a list of at most {MAX_TOKEN_ID_LIST} token ids "
            "(integers >= 0)")]


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the parameters name must be the model's (the engine would refuse them too,
    but without naming the field)."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("stop_token_ids", params.stop_token_ids)):
        if any(t >= vocab_size for t in ids):
            raise bad(name, f"'{name}' token ids must be in [0, {vocab_size})")


# -- fields accepted at no-op values only ----------------------------------------------------

def _same(value: object, allowed: object) -> bool:
    """JSON equality: ``true`` is not ``1`` (Python's ``True == 1`` is)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def _only(values: tuple[object, ...]) -> AfterValidator:
    shown = ", ".join(repr(ok) for ok in values)
    why = "{param} is not supported" + (f"; only {shown} is accepted" if shown else "")

    def check(value: object) -> object:
        if not any(_same(value, ok) for ok in values):
            raise fail(why)
        return value

    return AfterValidator(check)


def no_op_fields(model: type[Model], no_ops: Mapping[str, tuple[object, ...]]) -> type[Model]:
    """``model`` with the fields it accepts only at values that change nothing (null
    included), and those it ignores whatever their value (request_fields.py)."""
    fields: dict[str, Any] = {name: (Any, None) for name in sorted(request_fields.IGNORED)}
    for name, values in no_ops.items():
        schema = {"enum": list(values)} if values else {"type": "null"}
        fields[name] = (Annotated[Any, _only(values), WithJsonSchema(schema)], None)
    return create_model(model.__name__, __base__=model, __module__=model.__module__,
                        __doc__=model.__doc__, **fields)
