"""The router's admission (issue 15): a bounded number of requests in flight, taken before any
work is done on the prompt, and the tokenizer's work kept off the event loop.

Before, the router tokenized and applied the chat template on its event loop and only then
checked its concurrency limit: an overloaded router spent its CPU on prompts it would refuse,
and a long prompt or template stalled every stream and health probe it served meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cleave.runtime.serving import protocol as api

T = TypeVar("T")


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        # One thread: a fast tokenizer must not be used by two threads at once (it raises
        # "Already borrowed"), and one is enough to keep the event loop free; admission bounds
        # the queue in front of it.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cleave-tokenize")

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of ``limit`` slots for the whole request, or a 429 at once."""
        if self.active >= self.limit:
            raise api.APIError(429, "too many requests in flight; retry shortly",
                               "rate_limit_exceeded")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the tokenizer thread: tokenizing, and building a whole
        response (whose tokens' texts the tokenizer decodes; with prompt scores, seconds)."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
