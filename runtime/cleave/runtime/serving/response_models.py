"""The router's response bodies as pydantic models: the one definition of what it sends.

responses.py builds every body through them (validated), the router serializes them, and the
OpenAPI document's response schemas are generated from them (openapi.py). Names and shapes are
OpenAI's (the official client's types parse them; tests check every body the router sends) plus
vLLM's extra fields. A field is either always on the wire (``null`` when it has no value, as
``logprobs`` and ``finish_reason``) or, declared with :func:`omitted`, left out when it has
none (a delta's ``role``, a chunk's ``usage``): the schema says which.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MIN_LOGPROB: Final = -9999.0  # OpenAI's "too unlikely to report"; JSON has no -Infinity
FinishReason = Literal["stop", "length", "tool_calls"]


def _without_null(schema: dict[str, Any]) -> None:
    schema.pop("default", None)
    branches = [b for b in schema.pop("anyOf", []) if b != {"type": "null"}]
    if len(branches) == 1:
        schema.update(branches[0])
    elif branches:
        schema["anyOf"] = branches


def _omittable(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """Every field is on the wire, so required, except those left out when None: those are
    optional and, when there, never null."""
    required = schema.get("required", [])
    for name, info in cls.model_fields.items():
        if info.exclude_if is not None:
            if name in required:
                required.remove(name)
            _without_null(schema["properties"][name])
    if not required:
        schema.pop("required", None)


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_serialization_defaults_required=True,
                              json_schema_extra=_omittable)


def _is_none(value: object) -> bool:
    return value is None


def omitted() -> Any:
    """A field left off the wire when None (``Any``: as pydantic's own ``Field`` is typed)."""
    return Field(None, exclude_if=_is_none)


def _clamped(value: object) -> object:
    # -inf (a token the sampler could never pick) and NaN: not JSON; NaN fails the comparison.
    return MIN_LOGPROB if isinstance(value, float) and not value >= MIN_LOGPROB else value


# The validator wraps the constraints (it comes after them), so it runs first.
Logprob = Annotated[float, Field(ge=MIN_LOGPROB, allow_inf_nan=False),
                    BeforeValidator(_clamped)]
Count = Annotated[int, Field(ge=0)]


# -- usage -----------------------------------------------------------------------------------

class PromptTokensDetails(Wire):
    cached_tokens: Count


class CompletionUsage(Wire):
    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count
    # null: the router hides cached_tokens (--prompt-tokens-details hide), as vLLM without
    # --enable-prompt-tokens-details
    prompt_tokens_details: PromptTokensDetails | None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None) -> CompletionUsage:
        details = None if cached_tokens is None else PromptTokensDetails(
            cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=details)


# -- logprobs --------------------------------------------------------------------------------

class CompletionLogprobs(Wire):
    """The legacy completions shape: parallel lists, one entry per token; null for a token with
    no score (an echoed prompt's first: nothing comes before it)."""
    tokens: list[str]
    token_logprobs: list[Logprob | None]
    top_logprobs: list[dict[str, Logprob] | None]
    text_offset: list[Count]  # where each token starts in the choice's text


class TopLogprob(Wire):
    token: str
    logprob: Logprob
    bytes: list[Annotated[int, Field(ge=0, le=255)]]  # the token's UTF-8


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Wire):
    content: list[ChatCompletionTokenLogprob]


class PromptLogprob(Wire):
    """One of vLLM's ``prompt_logprobs`` scores (logprobs.PromptScores.field)."""
    logprob: Logprob
    rank: Annotated[int, Field(ge=1)] | None  # 1 + the tokens likelier than it
    decoded_token: str


# vLLM's prompt_logprobs: null for the first token, then each token's scores by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# -- tool calls ------------------------------------------------------------------------------

class CalledFunction(Wire):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatCompletionMessageToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChoiceDeltaFunction(Wire):
    name: str | None = omitted()
    arguments: str


class ChoiceDeltaToolCall(Wire):
    """A streamed piece of a call: the first has its id, type and name; the rest, arguments."""
    index: Count
    id: str | None = omitted()
    type: Literal["function"] | None = omitted()
    function: ChoiceDeltaFunction


# -- whole responses -------------------------------------------------------------------------

class CompletionChoice(Wire):
    index: Count
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = omitted()  # vLLM's, when asked: on each choice


class ChatCompletionMessage(Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls (OpenAI's)
    tool_calls: list[ChatCompletionMessageToolCall] | None = omitted()


class ChatCompletionChoice(Wire):
    index: Count
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class _Envelope(Wire):
    """What every completion and chunk starts with; each names its ``object``, which keeps
    its place here (field order is wire order)."""
    id: str
    object: str
    created: int
    model: str


class Completion(_Envelope):
    """``POST /v1/completions``."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ChatCompletion(_Envelope):
    """``POST /v1/chat/completions``."""
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None = omitted()  # vLLM's, when asked: on the response


# -- streamed chunks -------------------------------------------------------------------------

class CompletionChunkChoice(Wire):
    index: Count
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None  # null until the choice's last chunk


class CompletionChunk(_Envelope):
    """One server-sent event of a streamed completion; the last (``include_usage``) has no
    choices, only usage."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]
    usage: CompletionUsage | None = omitted()


class ChoiceDelta(Wire):
    """The first delta of a choice carries the role; the last may be empty."""
    role: Literal["assistant"] | None = omitted()
    content: str | None = omitted()
    tool_calls: list[ChoiceDeltaToolCall] | None = omitted()


class ChatCompletionChunkChoice(Wire):
    index: Count
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionChunkChoice]
    usage: CompletionUsage | None = omitted()


# -- the other endpoints ---------------------------------------------------------------------

class ModelCard(Wire):
    """OpenAI's fields plus vLLM's: the context length and what the model was loaded from
    (clients size prompts and pick tokenizers by them)."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: Count


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Wire):
    """vLLM's ``/tokenize``; ``token_strs`` is always null (vLLM's without
    ``return_token_strs``)."""
    count: Count
    max_model_len: Count
    tokens: list[Count]
    token_strs: None = None


class DetokenizeResponse(Wire):
    prompt: str


class VersionResponse(Wire):
    version: str


class StatusResponse(Wire):
    """``/health`` and ``/ready``."""
    status: str
