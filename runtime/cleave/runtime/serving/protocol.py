"""The router's OpenAI-compatible requests: pydantic models, the one source of validation and
of the OpenAPI document (openapi.py generates it from them).

Torch-free and I/O-free so the router and the tests use them directly. Requests are validated
strictly here, once, so everything behind the router can trust them; every rejection is an
:class:`APIError` naming the offending ``param``, as OpenAI does (request_types.api_error).
A field nobody defined is refused with a 400 naming it; vLLM's extensions that Cleave does not
implement are accepted only at values that change nothing (request_fields.py). A validated
request converts into the engine's ``SamplingParams`` in one place, :meth:`sampling_params`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, TypeVar

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cleave.runtime.engine.sequence import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    RequestError,
    SamplingParams,
)
from cleave.runtime.serving import request_fields, structured_fields
from cleave.runtime.serving.chat_models import MAX_TOOLS, Message, Tool, ToolChoice
from cleave.runtime.serving.chat_models import ROLES as ROLES
from cleave.runtime.serving.json_fields import APIError as APIError
from cleave.runtime.serving.json_fields import ErrorType as ErrorType
from cleave.runtime.serving.json_fields import JSONObject as JSONObject
from cleave.runtime.serving.json_fields import bad
from cleave.runtime.serving.prompt_fields import MAX_STOP as MAX_STOP
from cleave.runtime.serving.prompt_fields import MAX_STOP_CHARS as MAX_STOP_CHARS
from cleave.runtime.serving.prompt_fields import LogitBias, Prompt, Stop, StopTokenIds, no_op_fields
from cleave.runtime.serving.prompt_fields import check_token_ids as check_token_ids
from cleave.runtime.serving.request_types import (
    JSON_INT,
    Body,
    Bool,
    Loose,
    Number,
    Refusal,
    api_error,
    fail,
)
from cleave.runtime.serving.structured_models import (
    GuidedChoice,
    GuidedGrammar,
    GuidedJSON,
    GuidedRegex,
    ResponseFormat,
    StructuredOutputs,
)
from cleave.runtime.serving.tools import ToolRequest, parse_tools

# A request body trickled in slower than this is refused (router and workers): a slow client
# must not hold a handler, and its concurrency or admission slot, for ever.
BODY_READ_SECONDS: Final = 30.0
MAX_TEMPERATURE: Final = 2.0
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE: Final = 1.0  # OpenAI's default; the engine's own default is greedy
MAX_CHOICES: Final = 128  # n and best_of: OpenAI's bound on n
MAX_TOKENS_LIMIT: Final = 1 << 20  # far beyond any context: rejects absurd values early
CONTEXT_SERVED: Final = "served"  # model_validate's context: the served model names
Model = TypeVar("Model", bound=BaseModel)

Count = Annotated[int, Strict(), Field(ge=1, le=MAX_CHOICES), JSON_INT]
MaxTokens = Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_LIMIT), JSON_INT]
Logprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS), JSON_INT]
Penalty = Annotated[Number, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class StreamOptions(Loose):
    # Ignored, not refused, without stream: harmless, and what OpenAI does.
    include_usage: Bool = False


class _Request(Body):
    """What both endpoints take. ``model`` comes first: its error is the one reported."""
    model: Annotated[str, Strict(), Field(min_length=1),
                     Refusal("'model' is required and must be a non-empty string")]
    n: Count = 1
    temperature: Annotated[Number, Field(ge=0, le=MAX_TEMPERATURE)] = DEFAULT_TEMPERATURE
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Strict(), Field(ge=-1, le=INT64_MAX), JSON_INT] = Field(
        0, description="Extension (vLLM's): keep the k likeliest tokens; 0 or -1 is off.")
    seed: Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX), JSON_INT] | None = None
    stop: Stop = ()
    ignore_eos: Bool = Field(False, description="Extension: generate past end-of-sequence.")
    cache_salt: Annotated[str, Strict(), Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] \
        | None = Field(None, description="vLLM's extension: only requests with the same salt "
                       "share cached KV blocks.")
    stream: Bool = False
    stream_options: StreamOptions = StreamOptions()
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias = Field(default_factory=dict)
    repetition_penalty: Annotated[Number, Field(gt=0, le=MAX_REPETITION_PENALTY)] = Field(
        1.0, description="Extension (vLLM's): over prompt and output.")
    min_p: Annotated[Number, Field(ge=0, le=1)] = Field(0.0, description="Extension (vLLM's).")
    min_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS_LIMIT), JSON_INT] = Field(
        0, description="Extension (vLLM's): at most max_tokens.")
    stop_token_ids: StopTokenIds = ()
    # Structured outputs (structured_fields.py): at most one of these, and it must compile.
    response_format: ResponseFormat | None = None
    guided_json: GuidedJSON | None = None
    guided_regex: GuidedRegex | None = None
    guided_choice: GuidedChoice | None = None
    guided_grammar: GuidedGrammar | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's): exactly one of its keys, not null.")
    prompt_logprobs: Logprobs | None = Field(
        None, description="Extension (vLLM's): each prompt token's logprob and rank, and the "
        "top k there (not streamed).")
    _grammar: str | None = PrivateAttr(None)

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        served = (info.context or {}).get(CONTEXT_SERVED)
        if served is not None and model not in served:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"{', '.join(served) or 'no models'}", param="model",
                           code="model_not_found")
        return model

    # The model's checks run in this order: the cheap ones before the grammar's compile.
    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _Request:
        if self.stream and self.prompt_logprobs is not None:  # vLLM refuses it too
            raise fail("'prompt_logprobs' cannot be streamed", "prompt_logprobs")
        return self

    @model_validator(mode="after")
    def _compile_grammar(self) -> _Request:
        asked = {name: getattr(self, name) for name in structured_fields.FIELDS}
        self._grammar = structured_fields.grammar(asked)  # APIError naming the field
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options.include_usage

    @property
    def sequences(self) -> int:
        """Sequences generated: the n likeliest are returned."""
        return self.n

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        """The engine's meaning: None for none, n for the chosen token + top n."""
        raise NotImplementedError

    @property
    def echo_logprobs(self) -> int | None:
        """Completions' echo with logprobs: the top n of the prompt's logprobs there."""
        return None

    def _prompt_logprobs(self) -> int | None:
        """The engine's top n over the prompt: for the field and for an echo, as vLLM's."""
        return max((n for n in (self.prompt_logprobs, self.echo_logprobs) if n is not None),
                   default=None)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; ``default_max_tokens`` when the request gives none
        (OpenAI's 16, or what the context allows)."""
        max_tokens = self._max_tokens()
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                logprobs=self._logprobs(), prompt_logprobs=self._prompt_logprobs(),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=tuple((int(t), b) for t, b in self.logit_bias.items()),
                min_p=self.min_p, min_tokens=self.min_tokens,
                stop_token_ids=tuple(self.stop_token_ids), grammar=self._grammar,
                cache_salt=self.cache_salt)
        except RequestError as e:  # e.g. a default_max_tokens of 0: the prompt fills the context
            named = [f for f in ("min_tokens", "max_tokens", "ignore_eos")
                     if str(e).startswith(f)]
            raise bad(named[0] if named else None, str(e)) from None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    logprobs: Logprobs | None = None
    echo: Bool = Field(False, description="With logprobs, the prompt's come first.")
    best_of: Count | None = Field(None, description="At least n; greater than n only "
                                  "unstreamed.")
    suffix: Annotated[str, Strict(), Field(max_length=0),
                      Refusal("'suffix' is not supported")] = ""

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise fail(f"'best_of' ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.sequences > self.n and self.stream:
            raise fail("'best_of' greater than n cannot be streamed (as OpenAI's)", "best_of")
        return self

    @property
    def sequences(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    # Replaced max_tokens in OpenAI's chat API: both are checked, the newer one wins.
    max_completion_tokens: MaxTokens | None = None
    logprobs: Bool = False
    # Ignored (not refused) without logprobs, as OpenAI does.
    top_logprobs: Logprobs | None = None
    tools: Annotated[tuple[Tool, ...], Field(max_length=MAX_TOOLS,
                                             description="Function names must differ.")] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Bool = True
    echo: Bool = Field(False, description="Extension (vLLM's): the answer starts with the last "
                       "message's content when that message is the assistant's.")
    _tool_request: ToolRequest | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        self._tool_request = parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self

    @property
    def tool_request(self) -> ToolRequest | None:
        return self._tool_request

    def template_messages(self) -> list[JSONObject]:
        """The messages as the engine's ``apply_chat_template`` takes them."""
        return [m.template() for m in self.messages]

    def _max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None \
            else self.max_completion_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# The models as clients see them: with vLLM's and OpenAI's fields that are accepted only at
# values that change nothing, and those ignored whatever their value (request_fields.py).
COMPLETION: Final[type[CompletionRequest]] = no_op_fields(
    CompletionRequest, request_fields.COMPLETION_NO_OPS)
CHAT: Final[type[ChatRequest]] = no_op_fields(ChatRequest, request_fields.CHAT_NO_OPS)


def validate(model: type[Model], body: object, served: Sequence[str] | None) -> Model:
    """``body`` (what ``json.loads`` returned) as ``model``, or the APIError naming why not."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body, context={CONTEXT_SERVED: served})
    except ValidationError as e:
        raise api_error(e, model) from None


def parse_completion_request(body: object, served_models: Sequence[str]) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body."""
    return validate(COMPLETION, body, served_models)


def parse_chat_request(body: object, served_models: Sequence[str]) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body."""
    return validate(CHAT, body, served_models)

