"""Drives the load: sends requests on the schedule until the request count or the duration is
reached, then waits for those in flight (each bounded by the client's timeout).

Setting ``stop`` (the CLI does on Ctrl-C) stops at once: requests still in flight are cancelled
and recorded as ``cancelled``, and the records gathered so far are returned.

Warm-up requests (:func:`warm_up`) run before, to completion, and are returned apart: nothing
of them reaches the measured records, and the measured clock starts after them.

Under an open loop with a concurrency cap, a request's latencies run from when it is sent, after
its wait for a free slot (as vLLM measures); the wait shows in the throughput instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass

import aiohttp

from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop, Schedule, arrival_offsets
from cleave.runtime.loadgen.client import ClientConfig, send
from cleave.runtime.loadgen.progress import Progress
from cleave.runtime.loadgen.record import CANCELLED, RequestRecord
from cleave.runtime.loadgen.workload import RequestSpec, Workload


@dataclass(frozen=True)
class Limits:
    """Stop sending after this many requests or this many seconds, whichever comes first."""

    num_requests: int | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("give a number of requests, a duration or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"the number of requests must be at least 1, not {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"the duration must be positive, not {self.duration}")

    def allows(self, index: int, elapsed: float) -> bool:
        if self.num_requests is not None and index >= self.num_requests:
            return False
        return self.duration is None or elapsed < self.duration


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]
    duration: float  # from the start until the last request ended
    interrupted: bool


class _Run:
    def __init__(self, session: aiohttp.ClientSession, cfg: ClientConfig, workload: Workload,
                 limits: Limits, progress: Progress) -> None:
        self.session = session
        self.cfg = cfg
        self.workload = workload
        self.limits = limits
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()
        self.slots: contextlib.AbstractAsyncContextManager[object] = contextlib.nullcontext()

    async def one(self, index: int, spec: RequestSpec | None = None) -> None:
        spec = spec or self.workload.request(index)
        async with self.slots:
            self.progress.on_sent()
            sent = time.perf_counter()
            try:
                r = await send(self.session, self.cfg, spec, self.start)
            except asyncio.CancelledError:
                self.records.append(RequestRecord(index, sent - self.start,
                                                  time.perf_counter() - sent,
                                                  error=CANCELLED, error_detail="interrupted"))
                raise
        self.records.append(r)
        self.progress.on_finished(r.ok)

    async def open_loop(self, schedule: OpenLoop, seed: int) -> None:
        if schedule.max_concurrency is not None:
            self.slots = asyncio.Semaphore(schedule.max_concurrency)
        # The TaskGroup cancels and awaits every request in flight if this task is cancelled.
        async with asyncio.TaskGroup() as tg:
            for index, offset in enumerate(arrival_offsets(schedule, seed)):
                if not self.limits.allows(index, offset):
                    break
                delay = self.start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tg.create_task(self.one(index))

    async def closed_loop(self, schedule: ClosedLoop) -> None:
        indices = itertools.count()

        async def user() -> None:
            while self.limits.allows(i := next(indices), time.perf_counter() - self.start):
                await self.one(i)

        async with asyncio.TaskGroup() as tg:
            for _ in range(schedule.concurrency):
                tg.create_task(user())


async def warm_up(session: aiohttp.ClientSession, cfg: ClientConfig, workload: Workload,
                  count: int, concurrency: int, progress: Progress) -> tuple[RequestRecord, ...]:
    """Send ``count`` warm-up requests (``workload.warmup``), ``concurrency`` at a time, and
    wait for all of them; their records are returned apart from any measured run's."""
    r = _Run(session, cfg, workload, Limits(count), progress)
    progress.start = r.start
    specs = iter([workload.warmup(i) for i in range(count)])

    async def user() -> None:
        for spec in specs:  # one shared iterator: each spec is sent once
            await r.one(spec.index, spec)

    async with asyncio.TaskGroup() as tg:
        for _ in range(max(1, min(concurrency, count))):
            tg.create_task(user())
    return tuple(r.records)


async def run(session: aiohttp.ClientSession, cfg: ClientConfig, workload: Workload,
              schedule: Schedule, limits: Limits, seed: int, progress: Progress,
              stop: asyncio.Event | None = None) -> RunResult:
    r = _Run(session, cfg, workload, limits, progress)
    progress.start = r.start
    load = asyncio.create_task(r.open_loop(schedule, seed) if isinstance(schedule, OpenLoop)
                               else r.closed_loop(schedule))
    drawing = asyncio.create_task(progress.run())
    stopped = asyncio.create_task((stop or asyncio.Event()).wait())
    try:
        await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = not load.done()
        for t in (load, stopped, drawing):
            t.cancel()
        await asyncio.gather(load, stopped, drawing, return_exceptions=True)
    finally:
        for t in (load, stopped, drawing):
            t.cancel()
    progress.draw(final=True, complete=not interrupted)
    failure = load.exception() if load.done() and not load.cancelled() else None
    if failure is not None:
        raise failure  # a bug, not a failed request (those become records): surface it
    end = max((x.start + x.e2e for x in r.records), default=time.perf_counter() - r.start)
    return RunResult(tuple(r.records), end, interrupted)
