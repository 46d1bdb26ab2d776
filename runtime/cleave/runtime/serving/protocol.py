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
from typing import Final, TypedDict

from cleave.runtime.engine.sequence import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    RequestError,
    SamplingParams,
)
from cleave.runtime.serving import request_fields as fields
from cleave.runtime.serving.json_fields import APIError as APIError
from cleave.runtime.serving.json_fields import ErrorType as ErrorType
from cleave.runtime.serving.json_fields import JSONObject as JSONObject
from cleave.runtime.serving.json_fields import as_int, bad, read_bool, read_float, read_int
from cleave.runtime.serving.sampling_fields import MAX_TOKENS_LIMIT as MAX_TOKENS_LIMIT
from cleave.runtime.serving.sampling_fields import LogitRules, logit_rules
from cleave.runtime.serving.sampling_fields import check_token_ids as check_token_ids
from cleave.runtime.serving.tools import ToolRequest, parse_tools, template_tool_calls

ROLES: Final = ("system", "user", "assistant", "developer", "tool")
MAX_STOP: Final = 4  # OpenAI's limit on stop sequences
# Each stop string's length: far beyond any real one, and what keeps checking the output
# against them cheap (the router and every worker refuse longer ones).
MAX_STOP_CHARS: Final = 1024
# A request body trickled in slower than this is refused (router and workers): a slow client
# must not hold a handler, and its concurrency or admission slot, for ever.
BODY_READ_SECONDS: Final = 30.0
MAX_TEMPERATURE: Final = 2.0
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE: Final = 1.0  # OpenAI's default; the engine's own default is greedy
MAX_CHOICES: Final = 128  # n and best_of: OpenAI's bound on n


# -- requests --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[JSONObject, ...] = ()  # an assistant's calls (tools.template_tool_calls)
    tool_call_id: str | None = None  # a tool result's call

    def template(self) -> JSONObject:
        """The message as chat templates take it (``apply_chat_template``)."""
        out: JSONObject = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


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
    logits: LogitRules
    n: int  # choices returned
    best_of: int  # sequences generated, the n likeliest returned; n unless asked
    cache_salt: str | None  # vLLM's: only requests with the same salt share cached KV

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                  top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                  stop=self.stop, ignore_eos=self.ignore_eos,
                                  logprobs=self.logprobs, cache_salt=self.cache_salt,
                                  **self.logits._asdict())
        except RequestError as e:  # e.g. a default_max_tokens of 0: the prompt fills the context
            named = [f for f in ("min_tokens", "max_tokens", "ignore_eos")
                     if str(e).startswith(f)]
            raise bad(named[0] if named else None, str(e)) from None


@dataclass(frozen=True)
class CompletionRequest(_Request):
    prompt: str | tuple[int, ...]
    echo: bool = False  # the prompt's text goes in front of each choice's


@dataclass(frozen=True)
class ChatRequest(_Request):
    messages: tuple[ChatMessage, ...]
    tools: ToolRequest | None = None

    def template_messages(self) -> list[JSONObject]:
        """The messages as the engine's ``apply_chat_template`` takes them."""
        return [m.template() for m in self.messages]


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
    logits: LogitRules
    n: int
    cache_salt: str | None


# Fields OpenAI defines that we cannot honour: accepted only at their no-op value, because
# silently ignoring e.g. echo=true or a penalty would return something other than asked.
_UNSUPPORTED_COMPLETION: Final[dict[str, Callable[[object], bool]]] = {
    "suffix": lambda v: v == "",
}
_UNSUPPORTED_CHAT: Final[dict[str, Callable[[object], bool]]] = {}


def _parse_common(body: object, served_models: Sequence[str],
                  unsupported: Mapping[str, Callable[[object], bool]]) -> _Common:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' is required and must be a non-empty string")
    if model not in served_models:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(served_models) or 'no models'}", param="model",
                       code="model_not_found")
    for name, ok in unsupported.items():
        if body.get(name) is not None and not ok(body[name]):
            raise bad(name, f"'{name}' is not supported")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP
                                 and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                         for s in stop)):
        raise bad("stop", f"'stop' must be a non-empty string of at most {MAX_STOP_CHARS} "
                   f"characters, or up to {MAX_STOP} of them")
    top_k = read_int(body, "top_k", -1, INT64_MAX)  # an extension (vLLM's); -1 means off, as there
    stream = bool(read_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    # stream_options is ignored, not refused, without stream: harmless, and what the schema says.
    include_usage = bool(read_bool(options or {}, "include_usage", "stream_options.include_usage"))
    include_usage = include_usage and stream
    temperature = read_float(body, "temperature", 0.0, MAX_TEMPERATURE)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise bad("cache_salt", f"'cache_salt' must be a non-empty string of at most "
                   f"{MAX_CACHE_SALT_CHARS} characters")
    return _Common(
        model=model,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=read_float(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0,
        top_k=max(top_k or 0, 0),
        seed=read_int(body, "seed", INT64_MIN, INT64_MAX),
        stop=tuple(stop or ()),
        ignore_eos=bool(read_bool(body, "ignore_eos")),
        stream=stream,
        include_usage=include_usage,
        logits=logit_rules(body),
        n=read_int(body, "n", 1, MAX_CHOICES) or 1,
        cache_salt=salt,
    )


def _prompt(v: object) -> str | tuple[int, ...]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one, as clients that always batch send it
    if v == "" or v == []:
        raise bad("prompt", "'prompt' must not be empty")
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        ids = [as_int(t) for t in v]
        if all(i is not None and i >= 0 for i in ids):
            return tuple(i for i in ids if i is not None)
        if any(isinstance(t, (str, list)) for t in v):
            raise bad("prompt", "batched prompts are not supported; send one per request")
    raise bad("prompt", "'prompt' must be a string, a list of token ids (integers >= 0), "
                         "or a list holding one of those")


def _content(v: object, param: str, role: str) -> str:
    if isinstance(v, str):
        return v
    if v is None and role == "assistant":  # OpenAI allows it (for tool calls); nothing to say
        return ""
    if not isinstance(v, list):
        raise bad(param, f"'{param}' must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(v):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise bad(f"{param}[{j}]", f"'{param}[{j}]' must be "
                       '{"type": "text", "text": <string>}; only text is supported')
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def _messages(v: object) -> tuple[ChatMessage, ...]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {ROLES}")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad(f"messages[{i}].tool_calls", "only assistant messages have 'tool_calls'")
        # Optional, as vLLM takes it (Llama's and Qwen's templates do not use it); ignored
        # on other roles, as 'name' is.
        call_id = m.get("tool_call_id") if role == "tool" else None
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id",
                      f"'messages[{i}].tool_call_id' must be a string")
        out.append(ChatMessage(
            role, _content(m.get("content"), f"messages[{i}].content", role),
            template_tool_calls(calls, f"messages[{i}].tool_calls") if calls is not None else (),
            call_id))
    return tuple(out)


def _refuse_fields(body: Mapping[str, object], known: frozenset[str],
                   no_ops: Mapping[str, tuple[object, ...]]) -> None:
    """Unknown fields, and extensions at values that would change the output: request_fields."""
    refused = fields.refused_field(body, known, no_ops)
    if refused is not None:
        raise bad(*refused)


def parse_completion_request(body: object, served_models: Sequence[str]) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body (whatever ``json.loads`` returned)."""
    common = _parse_common(body, served_models, _UNSUPPORTED_COMPLETION)
    assert isinstance(body, dict)  # _parse_common checked it
    _refuse_fields(body, fields.COMPLETION_FIELDS, fields.COMPLETION_NO_OPS)
    if "prompt" not in body:
        raise bad("prompt", "'prompt' is required")
    best_of = read_int(body, "best_of", 1, MAX_CHOICES) or common["n"]
    if best_of < common["n"]:
        raise bad("best_of", f"'best_of' ({best_of}) must be at least n ({common['n']})")
    if best_of > common["n"] and common["stream"]:
        raise bad("best_of", "'best_of' greater than n cannot be streamed (as OpenAI's)")
    logprobs = read_int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = bool(read_bool(body, "echo"))
    if echo and logprobs is not None:
        raise bad("echo", "'echo' with 'logprobs' needs the prompt's logprobs, which this "
                   "server does not compute")
    return CompletionRequest(prompt=_prompt(body["prompt"]), echo=echo, best_of=best_of,
                             max_tokens=read_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT),
                             logprobs=logprobs, **common)


def parse_chat_request(body: object, served_models: Sequence[str]) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body (whatever ``json.loads`` returned)."""
    common = _parse_common(body, served_models, _UNSUPPORTED_CHAT)
    assert isinstance(body, dict)
    _refuse_fields(body, fields.CHAT_FIELDS | fields.TOOL_FIELDS, fields.CHAT_NO_OPS)
    messages = _messages(body.get("messages"))
    # max_completion_tokens replaced max_tokens in OpenAI's chat API: both are checked, the
    # newer one wins.
    max_tokens = read_int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_completion_tokens = read_int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    top = read_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    # top_logprobs without logprobs is ignored (not refused), as the schema allows it.
    logprobs = (top or 0) if read_bool(body, "logprobs") else None
    return ChatRequest(messages=messages, logprobs=logprobs, best_of=common["n"], **common,
                       tools=parse_tools(body),
                       max_tokens=max_tokens if max_completion_tokens is None
                       else max_completion_tokens)
