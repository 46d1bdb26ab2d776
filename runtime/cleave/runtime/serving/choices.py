"""Several choices from one prompt (``n``, ``best_of``): one sub-request per sequence, as
vLLM's engine fans a parent request out into child requests.

The prompt's KV is computed once: sequence 0 goes first, and the others start when its first
token arrives, by which time the prompt's full blocks sit in that worker's prefix cache (and in
the KV store, which every worker reads): the others compute only the prompt's last, partial
block. Each sequence is an ordinary request on the ordinary path (disaggregation, resumption
after a worker failure), seeded ``seed + index`` as vLLM seeds its children, so a seeded
request is reproducible choice by choice. ``best_of`` ranks the sequences by cumulative
logprob, as vLLM does, and returns the ``n`` likeliest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace

from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving.wire import TokenLine as Line

_INT64 = 1 << 64
_INT64_MIN = -(1 << 63)


def child_params(params: SamplingParams, index: int, ranked: bool) -> SamplingParams:
    """Sequence ``index``'s parameters: its own seed; logprobs when the sequences are ranked
    (best_of > n) and the request did not ask for them (they are dropped again after); the
    prompt's logprobs on sequence 0 only (the others share them, and read the cached prompt).
    """
    seed = None if params.seed is None else (params.seed + index - _INT64_MIN) % _INT64 \
        + _INT64_MIN  # stays a signed 64-bit integer, as the API's seeds are
    logprobs = 0 if ranked and params.logprobs is None else params.logprobs
    return replace(params, seed=seed, logprobs=logprobs,
                   prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def cumulative_logprob(lines: Sequence[Line]) -> float:
    return sum(e.logprob for line in lines for e in line.logprobs)


def best(sequences: Sequence[list[Line]], n: int) -> list[list[Line]]:
    """The ``n`` sequences of highest cumulative logprob, likeliest first (ties: lower index
    first, so the order is reproducible)."""
    ranked = sorted(range(len(sequences)), key=lambda i: (-cumulative_logprob(sequences[i]), i))
    return [sequences[i] for i in ranked[:n]]


async def merged(stream: Callable[[int], AsyncGenerator[Line, None]], count: int
                 ) -> AsyncIterator[tuple[int, Line]]:
    """The lines of ``count`` sequences as they come, each with its index. Sequence 0 starts
    alone; the rest when its first line (its first token) arrives. The first failure ends
    the whole; leaving early cancels every sequence still running (aborting it upstream)."""
    if count == 1:  # the common case: no task, no queue
        async with contextlib.aclosing(stream(0)) as lines:
            async for line in lines:
                yield 0, line
        return
    queue: asyncio.Queue[tuple[int, Line | BaseException | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for line in stream(index):
                await queue.put((index, line))
            await queue.put((index, None))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(0))]
    running = 1
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if len(tasks) == 1:  # sequence 0 has its first token (or ended): start the rest
                tasks += [asyncio.create_task(pump(i)) for i in range(1, count)]
                running += count - 1
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
