"""The router↔worker wire: every message of the workers' internal API as one typed model,
which both ends import (the router encodes requests and decodes replies, the worker the
reverse), and one error format, the same as the public API's (``{"error": {...}}``).

Strict: a wrong type is a 400 on the request (``sampling.top_k: 2.5``), never a failure on the
engine thread later. ``SamplingParams`` is the engine's own type; pydantic validates it as the
dataclass it is, so its ``__post_init__`` checks run here too. Unknown fields are refused on
what the worker reads: router and workers are one version, and a field one end does not know
would otherwise be silently dropped. What the router reads back ignores them, so a worker may
report more than a router reads.

The operator reads ``/internal/stats`` and posts ``/internal/role`` too, from its own image
(which has no runtime package): these models fix the JSON it reads; they do not change it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from cleave.runtime.engine.sequence import SamplingParams

KVLoadFailurePolicy = Literal["recompute", "fail"]


class _Request(BaseModel):
    """What a worker reads: strict types, no unknown fields."""
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _Reply(BaseModel):
    """What the router reads back: strict types; fields it does not know are ignored.

    Infinities travel as JSON's ``-Infinity`` (pydantic reads it back), not the default
    ``null``: a logprob of -inf (logits holding -inf) written as null made the whole line
    unreadable, which the router took for a failed worker."""
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True,
                              ser_json_inf_nan="constants")


# -- errors ----------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    # Every field is always written (the document says so): param and code as null.
    model_config = ConfigDict(extra="ignore", frozen=True,
                              json_schema_serialization_defaults_required=True)
    message: str = "rejected"
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorReply(BaseModel):
    """Every error body, the router's to clients (OpenAI's shape) and a worker's to the router."""
    model_config = ConfigDict(extra="ignore", frozen=True)
    error: ErrorDetail


def error_message(body: bytes) -> str:
    """A worker's error reply's message; a fixed one when the body is not an error reply."""
    try:
        return ErrorReply.model_validate_json(body).error.message
    except ValidationError:
        return "rejected by the worker"


# -- requests (router -> worker) -------------------------------------------------------------

class PrefillRequest(_Request):
    """``POST /internal/prefill``: compute the prompt's KV, store its full blocks, return the
    first token."""
    request_id: str | None = None  # None: the worker makes one up
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()


class GenerateRequest(PrefillRequest):
    """``POST /internal/generate``: the whole request; with ``first_token`` the decode of a
    prefilled one; with ``earlier_token_ids`` too, a resumed one (resume.py)."""
    first_token: int | None = None
    earlier_token_ids: list[int] = []
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"

    @model_validator(mode="after")
    def _earlier_needs_first(self) -> GenerateRequest:
        if self.earlier_token_ids and self.first_token is None:
            raise ValueError("earlier_token_ids needs first_token")
        return self


class RoleRequest(_Request):
    """``POST /internal/role``: flip the current role (worker_role.py)."""
    role: Literal["prefill", "decode"]


# -- replies (worker -> router) --------------------------------------------------------------

class LineLogprob(_Reply):
    """One token's logprob and the likeliest alternatives (token id, logprob); a prompt
    token's also has its rank."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None


# The widest a token id (or a rank) and a logprob are written: an int32 id, and a float's
# longest shortest-round-trip form (sign, 17 digits, point, three-digit exponent: 24 bytes).
_WIDEST_ID = (1 << 31) - 1
_WIDEST_LOGPROB = -1.2345678901234568e-300


def prompt_scores_bytes(request: PrefillRequest) -> int:
    """The most bytes the prompt scores ``request`` asks for take on a line: beyond its usual
    bound, what a router reading that request's lines allows one (a 3,000-token prompt at
    top 20 is about 1.6 MB on one line). Measured on the model itself, so it follows its shape."""
    top = request.sampling.prompt_logprobs
    if top is None:
        return 0
    widest = LineLogprob(token_id=_WIDEST_ID, logprob=_WIDEST_LOGPROB,
                         top=[(_WIDEST_ID, _WIDEST_LOGPROB)] * top, rank=_WIDEST_ID)
    return len(request.prompt_token_ids) * (len(widest.model_dump_json()) + 1)  # and a comma


class PrefillReply(_Reply):
    request_id: str
    first_token: int
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_blocks: int = 0
    # sampling.prompt_logprobs asked: prompt tokens 1.. scored, as on a TokenLine.
    prompt_logprobs: list[LineLogprob] | None = None


class TokenLine(_Reply):
    """One NDJSON line of ``/internal/generate``: the tokens since the last line. Counts are
    the request's so far; a line the router makes itself (a prefill's first token) has none."""
    token_ids: list[int] = []
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # None: not told (the router hides it: --prompt-tokens-details hide; usage then has no
    # prompt_tokens_details). Every line a worker writes has it.
    cached_tokens: int | None = None
    logprobs: list[LineLogprob] = []
    # sampling.prompt_logprobs asked: prompt tokens 1.. scored, on the line of the first
    # token only (none on a continuation: its prompt was scored where it was prefilled).
    prompt_logprobs: list[LineLogprob] | None = None


class WorkerStats(_Reply):
    """``GET /internal/stats``: what routing and the autoscalers read."""
    role: str | None = None  # prefill, decode or both (worker_role.ROLES)
    home_role: str | None = None
    flips: int = 0
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    kv_usage: float = 0.0
    draining: bool = False
    max_model_len: int | None = None
    # What a router needs to ask the store how much of a prompt is cached.
    kv_root_hash: str | None = None
    block_size: int | None = None
    kv_namespace: str | None = None


class RoleReply(_Reply):
    role: str
    previous: str
    home_role: str


def describe(error: ValidationError) -> str:
    """The first problem of a wire message, named by its dotted field path."""
    first: Any = error.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
