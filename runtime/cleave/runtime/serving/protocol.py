"""The router's OpenAI-compatible protocol: request validation and response shapes.

Torch-free and I/O-free so the router and the tests use it directly. Requests are validated
strictly here, once, so everything behind the router can trust them; every rejection is an
:class:`APIError` naming the offending ``param``, as OpenAI does. Responses are plain dicts in
exactly the shapes the official ``openai`` client parses. ``openapi.py`` describes the same
rules as a schema; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypedDict

from cleave.runtime.engine.sequence import (
    MAX_LOGPROBS,
    RequestError,
    SamplingParams,
)

JSONObject = dict[str, Any]
ErrorType = Literal["invalid_request_error", "not_found_error", "authentication_error",
                    "rate_limit_exceeded", "server_error", "service_unavailable"]

ROLES: Final = ("system", "user", "assistant", "developer", "tool")
MAX_STOP: Final = 4  # OpenAI's limit on stop sequences
MAX_TOKENS_LIMIT: Final = 1 << 20  # far beyond any context: rejects absurd values before the engine
MAX_TEMPERATURE: Final = 2.0
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE: Final = 1.0  # OpenAI's default; the engine's own default is greedy


class APIError(Exception):
    """A failure to report to the client as OpenAI does: status code plus an ``error`` body."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type: ErrorType = type
        self.param = param
        self.code = code

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


# -- requests --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class _Request:
    model: str
    max_tokens: int | None  # None: the caller's default (OpenAI's 16, or what the context allows)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None  # the engine's meaning: None for none, n for the chosen token + top n
    stream: bool
    include_usage: bool

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                  top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                  stop=self.stop, ignore_eos=self.ignore_eos,
                                  logprobs=self.logprobs)
        except RequestError as e:  # e.g. a default_max_tokens of 0: the prompt fills the context
            raise _bad("max_tokens" if "max_tokens" in str(e) else None, str(e)) from None


@dataclass(frozen=True)
class CompletionRequest(_Request):
    prompt: str | tuple[int, ...]


@dataclass(frozen=True)
class ChatRequest(_Request):
    messages: tuple[ChatMessage, ...]

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the engine's ``apply_chat_template`` takes them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


class _Common(TypedDict):
    model: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _as_int(v: object) -> int | None:
    """``v`` as an int, or None. Booleans are not ints; 2.0 is, as in JSON Schema's "integer"."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _int(body: Mapping[str, object], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:  # JSON null means "not given", as OpenAI treats it
        return None
    i = _as_int(v)
    if i is None:
        raise _bad(name, f"'{name}' must be an integer")
    if not lo <= i <= hi:
        raise _bad(name, f"'{name}' must be in [{lo}, {hi}], got {i}")
    return i


def _float(body: Mapping[str, object], name: str, lo: float, hi: float,
           *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"'{name}' must be a number")
    # Compared before float(): a huge int would overflow it; NaN (json.loads accepts it) fails.
    if not ((lo < v if lo_open else lo <= v) and v <= hi):
        raise _bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: Mapping[str, object], name: str, param: str | None = None) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        param = param or name
        raise _bad(param, f"'{param}' must be a boolean")
    return v if isinstance(v, bool) else None


def _is_zero(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == 0


# Fields OpenAI defines that we cannot honour: accepted only at their no-op value, because
# silently ignoring e.g. echo=true or a penalty would return something other than asked.
_UNSUPPORTED_COMMON: Final[dict[str, Callable[[object], bool]]] = {
    "presence_penalty": _is_zero,
    "frequency_penalty": _is_zero,
    "logit_bias": lambda v: v == {},
}
_UNSUPPORTED_COMPLETION: Final[dict[str, Callable[[object], bool]]] = {
    **_UNSUPPORTED_COMMON,
    "echo": lambda v: v is False,
    "best_of": lambda v: _as_int(v) == 1,
    "suffix": lambda v: v == "",
}
_UNSUPPORTED_CHAT: Final[dict[str, Callable[[object], bool]]] = {
    **_UNSUPPORTED_COMMON,
    "tools": lambda v: v == [],
    "response_format": lambda v: v == {"type": "text"},
}


def _parse_common(body: object, served_models: Sequence[str],
                  unsupported: Mapping[str, Callable[[object], bool]]) -> _Common:
    if not isinstance(body, dict):
        raise _bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required and must be a non-empty string")
    if model not in served_models:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(served_models) or 'no models'}", param="model",
                       code="model_not_found")
    if body.get("n") is not None and _as_int(body["n"]) != 1:
        raise _bad("n", "only n=1 is supported")
    for name, ok in unsupported.items():
        if body.get(name) is not None and not ok(body[name]):
            raise _bad(name, f"'{name}' is not supported")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP
                                 and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"'stop' must be a non-empty string or up to {MAX_STOP} of them")
    top_k = _int(body, "top_k", -1, INT64_MAX)  # an extension (vLLM's); -1 means off, as there
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object")
    # stream_options is ignored, not refused, without stream: harmless, and what the schema says.
    include_usage = bool(_bool(options or {}, "include_usage", "stream_options.include_usage"))
    include_usage = include_usage and stream
    temperature = _float(body, "temperature", 0.0, MAX_TEMPERATURE)
    return _Common(
        model=model,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=_float(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0,
        top_k=max(top_k or 0, 0),
        seed=_int(body, "seed", INT64_MIN, INT64_MAX),
        stop=tuple(stop or ()),
        ignore_eos=bool(_bool(body, "ignore_eos")),
        stream=stream,
        include_usage=include_usage,
    )


def _prompt(v: object) -> str | tuple[int, ...]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one, as clients that always batch send it
    if v == "" or v == []:
        raise _bad("prompt", "'prompt' must not be empty")
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        ids = [_as_int(t) for t in v]
        if all(i is not None and i >= 0 for i in ids):
            return tuple(i for i in ids if i is not None)
        if any(isinstance(t, (str, list)) for t in v):
            raise _bad("prompt", "batched prompts are not supported; send one per request")
    raise _bad("prompt", "'prompt' must be a string, a list of token ids (integers >= 0), "
                         "or a list holding one of those")


def _content(v: object, param: str, role: str) -> str:
    if isinstance(v, str):
        return v
    if v is None and role == "assistant":  # OpenAI allows it (for tool calls); nothing to say
        return ""
    if not isinstance(v, list):
        raise _bad(param, f"'{param}' must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(v):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]' must be "
                       '{"type": "text", "text": <string>}; only text is supported')
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def _messages(v: object) -> tuple[ChatMessage, ...]:
    if not isinstance(v, list) or not v:
        raise _bad("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {ROLES}")
        out.append(ChatMessage(role, _content(m.get("content"), f"messages[{i}].content", role)))
    return tuple(out)


def parse_completion_request(body: object, served_models: Sequence[str]) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body (whatever ``json.loads`` returned)."""
    common = _parse_common(body, served_models, _UNSUPPORTED_COMPLETION)
    assert isinstance(body, dict)  # _parse_common checked it
    if "prompt" not in body:
        raise _bad("prompt", "'prompt' is required")
    return CompletionRequest(prompt=_prompt(body["prompt"]),
                             max_tokens=_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT),
                             logprobs=_int(body, "logprobs", 0, MAX_LOGPROBS), **common)


def parse_chat_request(body: object, served_models: Sequence[str]) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body (whatever ``json.loads`` returned)."""
    common = _parse_common(body, served_models, _UNSUPPORTED_CHAT)
    assert isinstance(body, dict)
    messages = _messages(body.get("messages"))
    # max_completion_tokens replaced max_tokens in OpenAI's chat API: both are checked, the
    # newer one wins.
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_completion_tokens = _int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    # top_logprobs without logprobs is ignored (not refused), as the schema allows it.
    logprobs = (top or 0) if _bool(body, "logprobs") else None
    return ChatRequest(messages=messages, logprobs=logprobs, **common,
                       max_tokens=max_tokens if max_completion_tokens is None
                       else max_completion_tokens)
