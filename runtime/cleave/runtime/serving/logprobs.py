"""Logprobs in responses: the legacy completions shape, the chat shape, and the prompt's
(vLLM's ``prompt_logprobs`` field, and completions' ``echo`` with ``logprobs``).

The engine scores every prompt token but the first (nothing comes before it); the worker sends
the scores once, on the line of a request's first token (a prefill worker in its reply, which
the router turns into that line). With ``n`` choices, sequence 0 alone asks for them
(choices.child_params) and every choice shows them, as vLLM shows its request's on each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

from pydantic import TypeAdapter

from cleave.runtime.engine.sequence import TokenLogprob
from cleave.runtime.serving import response_models as rm
from cleave.runtime.serving.json_fields import APIError
from cleave.runtime.serving.response_models import MIN_LOGPROB as MIN_LOGPROB
from cleave.runtime.serving.wire import LineLogprob, TokenLine

# Plain dicts in the shapes of response_models.py, whose models validate each response whole
# (and clamp -inf and NaN logprobs to MIN_LOGPROB: JSON has neither).
JSONObject = dict[str, Any]
_PROMPT_LOGPROBS: Final = TypeAdapter(rm.PromptLogprobs)


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str],
                        text_offset: int = 0, unscored: Sequence[int] = ()) -> JSONObject:
    """The legacy completions shape; ``text_offset`` is where these tokens start in the text
    (pass the characters already streamed when building one chunk's logprobs), and each next
    one starts after the text of those before. ``unscored``: tokens in front that have no
    logprob (an echoed prompt's first), null in both lists as OpenAI's."""
    tokens = [token_text(t) for t in unscored] + [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    none: list[None] = [None] * len(unscored)
    return {"tokens": tokens,
            "token_logprobs": [*none, *(lp.logprob for lp in logprobs)],
            "top_logprobs": [*none, *({token_text(i): x for i, x in lp.top}
                                      for lp in logprobs)],
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprob],
                  token_text: Callable[[int], str]) -> JSONObject:
    def entry(token_id: int, logprob: float) -> JSONObject:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, x) for i, x in lp.top]} for lp in logprobs]}


def line_logprobs(line: TokenLine) -> list[TokenLogprob]:
    """A worker line's output logprobs, as the engine's."""
    return [TokenLogprob(e.token_id, e.logprob, tuple(e.top)) for e in line.logprobs]


# -- the prompt's ----------------------------------------------------------------------------

class PromptScores:
    """One request's prompt logprobs: ``top`` for vLLM's field, ``echo_top`` for an echo's
    legacy logprobs (None: not asked), and the prompt's first token, echoed unscored."""

    def __init__(self, first_token: int, top: int | None, echo_top: int | None) -> None:
        self.first_token = first_token
        self.top = top
        self.echo_top = echo_top
        self._entries: list[LineLogprob] | None = None
        self._echoed: list[TokenLogprob] | None = None

    def check_size(self, prompt_tokens: int, choices: int, limit: int) -> None:
        """A 400 when the response would carry more than ``limit`` scores: prompt tokens x
        (top + 1) x choices, for the field and for an echo each. Building, validating and
        sending them costs about that many entries' work (docs/architecture.md)."""
        per_token = sum(top + 1 for top in (self.top, self.echo_top) if top is not None)
        count = prompt_tokens * per_token * choices
        if count > limit:
            raise APIError(
                400, f"this response would carry {count} prompt logprobs ({prompt_tokens} "
                f"prompt tokens x (top + 1) x {choices} choices); this server allows {limit}",
                param="prompt_logprobs" if self.top is not None else "logprobs")

    def take(self, line: TokenLine) -> None:
        """Keep the scores a line carries (the first that does: there is one)."""
        if self._entries is None and line.prompt_logprobs is not None:
            self._entries = line.prompt_logprobs

    @property
    def entries(self) -> list[LineLogprob]:
        if self._entries is None:  # a worker that does not know the field: a bug, not the user's
            raise APIError(502, "the worker sent no prompt logprobs", "server_error",
                           code="worker_failed")
        return self._entries

    def field(self, token_text: Callable[[int], str]) -> rm.PromptLogprobs:
        """vLLM's ``prompt_logprobs``: null for the first token, then for each one
        ``{token id: {logprob, rank, decoded_token}}``, the prompt's own token first, then the
        likeliest ``top`` (which may hold it: it is listed once). Validated here, once: every
        choice shows this one list, which a response's model then takes as it is."""
        text = functools.cache(token_text)  # the likeliest tokens recur: each decoded once

        def one(token_id: int, logprob: float, rank: int | None) -> JSONObject:
            return {"logprob": logprob, "rank": rank, "decoded_token": text(token_id)}

        out: list[JSONObject | None] = [None]
        for e in self.entries:
            scores = {str(e.token_id): one(e.token_id, e.logprob, e.rank)}
            for rank, (token_id, logprob) in enumerate(e.top[:self.top], start=1):
                scores.setdefault(str(token_id), one(token_id, logprob, rank))
            out.append(scores)
        return _PROMPT_LOGPROBS.validate_python(out)

    def echoed(self, generated: list[TokenLogprob]) -> tuple[list[int], list[TokenLogprob]]:
        """An echo's legacy logprobs, as (unscored tokens in front, scored ones): the prompt's
        first token, then the rest of the prompt with its top ``echo_top``, then
        ``generated``."""
        if self._echoed is None:  # the same for every choice
            self._echoed = [TokenLogprob(e.token_id, e.logprob, tuple(e.top[:self.echo_top]))
                            for e in self.entries]
        return [self.first_token], self._echoed + generated
