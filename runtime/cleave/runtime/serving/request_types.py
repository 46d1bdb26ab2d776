"""The JSON types of the public API's request fields, the base of every request model, and
the one translation of a pydantic validation error into the OpenAI-shaped 400 naming its field.

JSON's reading, as OpenAI's server applies it: an integer may be written ``8.0`` (JSON Schema's
"integer" admits it) but never ``true`` or ``"8"``; a number is never a boolean, a string, NaN
or infinite; JSON null means "not given" (:class:`Body` drops it before validation, and the
OpenAPI document marks every optional field nullable: openapi.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, get_args

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from typing_extensions import TypeAliasType

from cleave.runtime.serving.json_fields import APIError, bad


def _integral(v: object) -> object:
    """``8.0`` is the integer 8, as JSON Schema reads it; other values go on to the strict
    integer check, which refuses booleans and strings."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# Each integer field is `Annotated[int, Field(bounds...), *JSON_INT]`-shaped: the bounds sit on
# the strict integer, so that the schema states them, and the float reading wraps it.
JSON_INT: Final = BeforeValidator(_integral)
Number = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
# A named schema ($defs/TokenId): the document bounds it by the vocabulary when it knows it.
TokenId = TypeAliasType("TokenId", Annotated[int, Strict(), Field(ge=0), JSON_INT])


class Refusal:
    """Field metadata: any error inside the field is reported as the field itself with this
    message (a union's or a container's inner path would tell the client nothing more)."""

    def __init__(self, message: str) -> None:
        self.message = message


def fail(message: str, param: str | None = None, sub: str = "") -> PydanticCustomError:
    """A validator's error. It names the field it is raised in, plus ``sub`` (``[0]``: an item
    of it), or ``param`` instead; ``{param}`` in ``message`` becomes that name."""
    return PydanticCustomError("cleave", "{message}",
                               {"message": message, "param": param, "sub": sub})


class Body(BaseModel):
    """A request object: frozen once validated; JSON null means "not given" for every field,
    so a field holds its default instead (``n: null`` is one choice)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = {f.alias or n for n, f in cls.model_fields.items()}
        return {k: v for k, v in data.items() if v is not None or k not in names}


class Loose(Body):
    """An object whose other fields are accepted and unused (a message's ``name``), as OpenAI
    and vLLM accept them."""
    model_config = ConfigDict(extra="ignore")


# -- errors ----------------------------------------------------------------------------------

def param_of(loc: Sequence[int | str]) -> str | None:
    """``("messages", 0, "content")`` -> ``messages[0].content``; union tags (``<...>``) go."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("<"):
            out += f".{part}" if out else part
    return out or None


def _refusal(metadata: Sequence[object], annotation: object) -> Refusal | None:
    """The field's Refusal, also where its type is ``X | None`` and X carries it."""
    found = [m for m in metadata if isinstance(m, Refusal)]
    for arg in get_args(annotation):  # the members of a union, the metadata of an Annotated
        inner = _refusal(getattr(arg, "__metadata__", ()), arg)
        found += [inner] if inner is not None else []
    found += [m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, Refusal)]
    return found[0] if found else None


def _bounds(ctx: Mapping[str, Any]) -> str:
    return " and ".join(f"{op} {ctx[key]}" for key, op in (
        ("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if key in ctx)


_KINDS: Final = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "a boolean", "bool_parsing": "a boolean", "string_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object",
    "none_required": "null (or absent) here"}


def _message(error: ErrorDetails, param: str | None) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    name = f"'{param}'" if param else "the request body"
    if kind == "missing":
        return f"{name} is required"
    if kind == "extra_forbidden":
        return f"unknown field '{param}'"
    if kind in _KINDS:
        return f"{name} must be {_KINDS[kind]}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{name} must be {_bounds(ctx)}, got {error['input']!r}"
    if kind in ("too_short", "string_too_short"):
        return f"{name} must not be empty" if ctx.get("min_length") == 1 else \
            f"{name} must have at least {ctx.get('min_length')}"
    if kind in ("too_long", "string_too_long"):
        return f"{name} must have at most {ctx.get('max_length')}"
    return f"{name}: {error['msg']}"


def api_error(error: ValidationError, model: type[BaseModel]) -> APIError:
    """The client's 400 for a body the model refused: its first problem, named by ``param``
    as OpenAI names fields (``messages[0].content``)."""
    first = error.errors(include_url=False)[0]
    loc = first["loc"]
    if first["type"] == "cleave":
        ctx = first.get("ctx") or {}
        param = ctx.get("param") or (param_of(loc) or "") + str(ctx.get("sub") or "") or None
        return bad(param, str(ctx["message"]).replace("{param}", f"'{param}'"))
    field = model.model_fields.get(str(loc[0])) if loc else None
    refusal = _refusal(field.metadata, field.annotation) if field else None
    if refusal is not None:
        return bad(str(loc[0]), refusal.message)
    param = param_of(loc)
    if param is None and first["type"] in ("model_type", "dict_type"):
        return bad(None, "the request body must be a JSON object")
    return bad(param, _message(first, param))
