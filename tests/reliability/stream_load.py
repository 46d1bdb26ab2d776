"""A streaming load generator on the official ``openai`` client, and what it measured.

Every client loops for the run's duration, sending one streamed request at a time (completions
and chat, short prompts served decode-only and long ones disaggregated) with a per-request
timeout, and checks each stream is complete and well-formed: one id, deltas without a finish
reason, exactly one finishing chunk, then the usage chunk (``stream_options.include_usage``)
with token counts that agree with what was asked, and text equal to the reference: the same
stack's non-streamed answer to the same request, fetched once before the load starts (every
request is greedy, so a resumed stream that repeats or drops a token differs from it). Clients
draw their requests from a fixed pool of specs so that there is one reference per spec. Each
request ends in one ``Outcome``:

- ``ok``: complete and well-formed;
- ``retryable``: a clear error a client can retry: an HTTP 429/503 with ``Retry-After``, or
  an in-band SSE error event naming the failure (the stream was cut mid-response);
- ``failed``: anything else: a malformed or truncated stream, a dropped connection, another
  status, or a request that ran past its timeout (``hung``).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

SENTENCE = ("the cat walks a long letter in the morning the engineer builds many books before "
            "dinner our teacher reads the next request with great care a robot counts three "
            "apples near the station every student learns the blue sky after the rain")
WORDS = tuple(SENTENCE.split(" "))
SHARED_PREFIX = "You are a helpful assistant. Answer briefly and do not repeat yourself. "
SPECS = 128  # distinct requests: each gets one reference answer before the load


@dataclass(frozen=True)
class Outcome:
    start: float  # seconds since the run began
    end: float
    ttft: float | None  # seconds to the first content chunk
    status: str  # "ok", "retryable" or "failed"
    detail: str = ""


class MalformedStream(AssertionError):
    pass


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise MalformedStream(what)


@dataclass(frozen=True)
class Spec:
    """One request of the pool the clients draw from."""

    chat: bool
    prompt: str
    max_tokens: int
    ignore_eos: bool

    def body(self, model: str, timeout: float) -> dict[str, Any]:
        return {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0,
                "timeout": timeout, "extra_body": {"ignore_eos": self.ignore_eos}}


def request_specs(seed: int, n: int = SPECS) -> list[Spec]:
    rng = random.Random(seed)
    return [Spec(rng.random() < 0.5, _prompt(rng), rng.randint(8, 48), rng.random() < 0.75)
            for _ in range(n)]


def comparable(text: str) -> str:
    """``text`` without U+FFFD: the tiny random model emits lone UTF-8 bytes, and a stream
    renders them differently from the whole answer's decode (fewer replacement characters, or
    none where a stray byte precedes a valid sequence: a known difference, see the issue's
    closing note); every other character must match."""
    return text.replace("\ufffd", "")


def stream_text(chunks: Sequence[Any], chat: bool) -> str:
    """What the client received, chunk by chunk (not what the usage line claims)."""
    return "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                   for c in chunks if c.choices)


def check_stream(chunks: Sequence[Any], spec: Spec, want: str) -> None:
    """Raise :class:`MalformedStream` unless ``chunks`` are one whole, well-formed stream
    whose text is ``want``."""
    chat, max_tokens, ignore_eos = spec.chat, spec.max_tokens, spec.ignore_eos
    _check(len(chunks) >= 2, f"only {len(chunks)} chunks")
    *body, last = chunks
    _check(len({c.id for c in chunks}) == 1, "chunk ids differ")
    kind = "chat.completion.chunk" if chat else "text_completion"
    _check(all(c.object == kind for c in chunks), f"a chunk is not a {kind}")
    _check(last.choices == [] and last.usage is not None, "no usage chunk at the end")
    _check(all(len(c.choices) == 1 and c.choices[0].index == 0 for c in body),
           "a body chunk has no single choice")
    reasons = [c.choices[0].finish_reason for c in body]
    _check(reasons[-1] in ("stop", "length") and reasons[:-1].count(None) == len(body) - 1,
           f"finish reasons {reasons[-3:]}: not exactly one, at the end")
    usage = last.usage
    _check(usage.prompt_tokens > 0 and usage.total_tokens ==
           usage.prompt_tokens + usage.completion_tokens, f"inconsistent usage {usage}")
    _check(1 <= usage.completion_tokens <= max_tokens, f"{usage.completion_tokens} tokens "
           f"for max_tokens={max_tokens}")
    if ignore_eos:
        _check(usage.completion_tokens == max_tokens and reasons[-1] == "length",
               f"ignore_eos: {usage.completion_tokens} tokens, reason {reasons[-1]}")
    if chat:
        _check(body[0].choices[0].delta.role == "assistant", "first chat delta has no role")
    got = stream_text(chunks, chat)
    _check(comparable(got) == comparable(want),
           f"text {got!r} differs from the reference {want!r}")


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((3, 6, 20, 40, 60))))
    return (SHARED_PREFIX + words) if rng.random() < 0.3 else words


def classify(error: BaseException) -> tuple[str, str]:
    """``(status, detail)`` for a request that raised."""
    if isinstance(error, MalformedStream):
        return "failed", f"malformed: {error}"
    if isinstance(error, openai.APITimeoutError | TimeoutError):
        return "failed", "hung: no answer within the request timeout"
    if isinstance(error, openai.APIStatusError):
        retry = error.response.headers.get("retry-after")
        if error.status_code in (429, 503) and retry:
            return "retryable", f"{error.status_code} Retry-After {retry}: {error.message}"
        return "failed", f"HTTP {error.status_code}: {error.message}"
    if isinstance(error, openai.APIConnectionError):
        return "failed", f"connection: {error.__cause__!r}"
    if isinstance(error, openai.APIError):  # an in-band SSE error event
        message = error.message or ""
        if error.body and isinstance(error.body, dict) and error.body.get("type"):
            return "retryable", f"in-band {error.body['type']}: {message}"
        return "failed", f"in-band error without a type: {message}"
    return "failed", f"{type(error).__name__}: {error}"


async def _create(client: openai.AsyncOpenAI, spec: Spec, common: dict[str, Any]) -> Any:
    if spec.chat:
        return await client.chat.completions.create(
            messages=[{"role": "user", "content": spec.prompt}], **common)
    return await client.completions.create(prompt=spec.prompt, **common)


async def references(client: openai.AsyncOpenAI, model: str, specs: Sequence[Spec],
                     timeout: float) -> dict[Spec, str]:
    """Each spec's non-streamed greedy text, asked of the healthy stack before any fault."""
    limit = asyncio.Semaphore(16)

    async def one(spec: Spec) -> str:
        async with limit:
            got = await _create(client, spec, spec.body(model, timeout))
        return str(got.choices[0].message.content if spec.chat else got.choices[0].text)

    texts = await asyncio.gather(*(one(s) for s in specs))
    return dict(zip(specs, texts, strict=True))


async def one_request(client: openai.AsyncOpenAI, model: str, spec: Spec, want: str,
                      timeout: float, t0: float) -> Outcome:
    chat = spec.chat
    common = spec.body(model, timeout) | {"stream": True,
                                          "stream_options": {"include_usage": True}}
    start = time.monotonic()
    ttft: float | None = None
    try:
        async with asyncio.timeout(timeout + 10):  # the client's own timeout, and a backstop
            stream = await _create(client, spec, common)
            chunks = []
            async for chunk in stream:
                if ttft is None and chunk.choices and (
                        chunk.choices[0].delta.content if chat else chunk.choices[0].text):
                    ttft = time.monotonic() - start
                chunks.append(chunk)
        check_stream(chunks, spec, want)
        status, detail = "ok", ""
    except Exception as e:
        status, detail = classify(e)
    return Outcome(start - t0, time.monotonic() - t0, ttft, status, detail)


@dataclass(frozen=True)
class Event:
    """A fault injected at ``at`` seconds into the run (``action`` blocks; it runs in a
    thread so the clients keep going)."""

    at: float
    name: str
    action: Callable[[], object]


@dataclass
class LoadResult:
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, name)

    def count(self, status: str, outcomes: Sequence[Outcome] | None = None) -> int:
        return sum(1 for o in (self.outcomes if outcomes is None else outcomes)
                   if o.status == status)

    def ttft_quantile(self, q: float) -> float:
        ttfts = sorted(o.ttft for o in self.outcomes if o.status == "ok" and o.ttft is not None)
        if not ttfts:
            return math.inf
        return ttfts[min(len(ttfts) - 1, math.ceil(q * len(ttfts)) - 1)]

    def ttft_over_neighbours(self, q: float, window: float) -> float:
        """The ``q`` quantile, over requests, of a request's TTFT over the median TTFT of the
        requests that started within ``window`` / 2 seconds of it.

        A load-independent fairness figure: a burst of work elsewhere on the machine slows
        every request of its moment alike, so the ratio stays near 1, while a request left
        waiting behind later ones (a stuck queue, a lost wake-up) stands out from its own
        neighbours whatever the machine's pace.
        """
        timed = sorted((o.start, o.ttft) for o in self.outcomes
                       if o.status == "ok" and o.ttft is not None)
        starts = [s for s, _ in timed]
        ratios = []
        for start, ttft in timed:
            lo = bisect.bisect_left(starts, start - window / 2)
            hi = bisect.bisect_right(starts, start + window / 2)
            ratios.append(ttft / max(statistics.median(t for _, t in timed[lo:hi]), 1e-3))
        if not ratios:  # nothing succeeded: the count asserts say so, not an IndexError
            return math.inf
        ratios.sort()
        return ratios[min(len(ratios) - 1, math.ceil(q * len(ratios)) - 1)]

    def overlapping(self, start: float, end: float) -> list[Outcome]:
        """Requests in flight at some point of ``[start, end)``."""
        return [o for o in self.outcomes if o.start < end and o.end > start]

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


async def run_load(base_url: str, model: str, *, clients: int, duration: float,
                   timeout: float, events: Sequence[Event] = (), tail: float = 0.0,
                   api_key: str = "-", seed: int = 0) -> LoadResult:
    """``clients`` concurrent streaming clients for ``duration`` seconds, events on cue.

    With ``tail``, the clients go on until ``tail`` seconds after the last event's action
    returned (a restart that is slow on a loaded box still gets its window of plain load),
    but never past three times ``duration``.
    """
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=timeout)
    result = LoadResult(duration)
    specs = request_specs(seed)
    want = await references(client, model, specs, timeout)
    t0 = time.monotonic()
    pending = len(events)
    last_event_end = 0.0

    def running() -> bool:
        elapsed = time.monotonic() - t0
        if elapsed >= 3 * duration:
            return False
        return elapsed < duration or pending > 0 or elapsed < last_event_end + tail

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while running():
            spec = rng.choice(specs)
            result.outcomes.append(await one_request(client, model, spec, want[spec],
                                                     timeout, t0))

    async def inject(event: Event) -> None:
        nonlocal pending, last_event_end
        await asyncio.sleep(max(0.0, event.at - (time.monotonic() - t0)))
        began = time.monotonic() - t0
        try:
            await asyncio.to_thread(event.action)
        finally:
            pending -= 1
            last_event_end = max(last_event_end, time.monotonic() - t0)
        result.events.append((began, last_event_end, event.name))

    tasks: list[Awaitable[None]] = [loop(i) for i in range(clients)]
    tasks += [inject(e) for e in events]
    try:
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    result.duration = time.monotonic() - t0
    return result
