"""What was measured for one request: the client fills it, the report and plots read it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Error classes (``RequestRecord.error``); HTTP failures are ``http_<status>``, e.g. ``http_503``.
TIMEOUT = "timeout"  # no complete answer within --timeout
CONNECTION = "connection"  # refused, reset, or the connection dropped mid-stream
MALFORMED = "malformed_stream"  # not SSE, bad JSON, or no `data: [DONE]` at the end
STREAM_ERROR = "stream_error"  # the server sent an error object inside the stream
CANCELLED = "cancelled"  # still in flight when the benchmark was interrupted (not an error)


def http_error(status: int) -> str:
    return f"http_{status}"


@dataclass(frozen=True)
class RequestRecord:
    """Times are seconds; ``start`` counts from the benchmark's start, the rest from ``start``."""

    index: int
    start: float
    e2e: float  # until the last byte, or until the failure
    ttft: float | None = None  # until the first chunk that carried output text
    chunk_times: tuple[float, ...] = ()  # arrival of every chunk that carried output text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False  # False: output_tokens counts text chunks instead
    error: str | None = None
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.ttft is None or self.output_tokens is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> tuple[float, ...]:
        """Gaps between consecutive output chunks (a chunk may carry several tokens)."""
        t = self.chunk_times
        return tuple(b - a for a, b in itertools.pairwise(t))
