"""Bounds a worker checks before any store lookup or engine work (issue 15).

The router validates what clients send, but a worker's internal API is reachable by whatever
holds the service's token, and a bug or a compromised router must not be able to make one
request cost minutes of the engine thread or gigabytes of buffers: every length the work
grows with is bounded here, from the engine's own context limit and the API's own limits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cleave.runtime.engine.sequence import RequestError, SamplingParams
from cleave.runtime.serving.protocol import MAX_STOP, MAX_STOP_CHARS


class Saturated(RuntimeError):
    """More requests are open on this worker than it admits: 503, the router tries another."""


def check_request(prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """Before the store is asked for the prompt's blocks (a read buffer sized by the prompt)
    and before the engine sees it."""
    total = prompt_tokens + params.max_tokens
    if prompt_tokens >= max_model_len or total > max_model_len:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
            f"{total} exceeds this model's maximum context of {max_model_len} tokens")
    if len(params.stop) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop strings")
    if any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise RequestError(f"a stop string has at most {MAX_STOP_CHARS} characters")


def check_earlier(earlier_tokens: int, params: SamplingParams) -> None:
    """A resumed request replays its earlier tokens one engine step each: they are output the
    request already produced, so fewer than its max_tokens."""
    if earlier_tokens >= params.max_tokens:
        raise RequestError(f"earlier_token_ids has {earlier_tokens} tokens: a resumed request "
                           f"has fewer than its max_tokens ({params.max_tokens})")


class Admission:
    """Counts the requests open on a worker (parsing, queued, running, streaming) and refuses
    one beyond ``limit``: an overloaded worker answers at once instead of letting its queue
    grow until the router's idle timeout sends the same request elsewhere with a fresh
    deadline, multiplying the work."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.open >= self.limit:
            raise Saturated(f"this worker has {self.open} requests open (its limit)")
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1
