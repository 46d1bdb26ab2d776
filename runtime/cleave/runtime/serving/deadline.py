"""One deadline per request, across every worker the router tries for it.

A retry used to get a fresh budget: a worker that went silent cost the idle timeout and the next
one started a new ``--request-timeout``, so a request could run for several times its limit (and
keep as many workers busy in turn). The router now makes one :class:`Deadline` when it starts
serving a request (after any scale-from-zero hold, which has its own bound); the prefill and
every decode attempt get what is left of it, and once nothing is left the client gets a 504.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cleave.runtime.serving.json_fields import APIError


@dataclass(frozen=True)
class Deadline:
    seconds: float  # the whole budget (for the message)
    at: float  # time.monotonic() at which it passes

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(seconds, time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left for the next call; the request's 504 when none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise APIError(504, f"the request did not finish within its {self.seconds:g} s "
                           "limit (every worker tried counts against it)", "server_error",
                           code="request_timeout")
        return left
