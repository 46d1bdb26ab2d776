"""The router's view of its workers: which exist, which are ready, and who waits for one.

Two pools (prefill and decode) are kept fresh by one poller: worker health and load, DNS
names, and the workers file that ``cleave up --autoscale`` rewrites. With a hold timeout, a
request that finds no worker ready waits here (counted in
``cleave_num_requests_waiting{role="router"}``, the demand an autoscaler reads to wake a role
at zero) instead of failing, and gets a 503 if none turns ready in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from cleave.runtime import metrics
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.membership import parse_members
from cleave.runtime.serving.routing import WorkerState
from cleave.runtime.serving.upstream import PrefillSpeed, WorkerPool

log = logging.getLogger("cleave.router")
POLL_SECONDS = 1.0  # worker health and membership
HELD_POLL_SECONDS = 0.2  # while requests wait for a first worker: notice it quickly


class Fleet:
    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str],
                 workers_file: str | None, hold_timeout_seconds: float) -> None:
        self._urls = (tuple(prefill_urls), tuple(decode_urls))
        self.workers_file = workers_file
        self.hold_timeout_seconds = hold_timeout_seconds
        self.held = 0  # requests waiting for a first ready decode worker
        self._wake_poller = asyncio.Event()
        self._members_error: str | None = None
        self._poller: asyncio.Task[None] | None = None
        self.speed = PrefillSpeed()
        metrics.WAITING.labels("router").set_function(lambda: self.held)
        self.prefill: WorkerPool
        self.decode: WorkerPool

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.prefill = WorkerPool(self._urls[0], session, self.speed)
        self.decode = WorkerPool(self._urls[1], session, self.speed)
        self._read_members()
        await asyncio.gather(self.prefill.refresh(), self.decode.refresh())
        self._poller = asyncio.create_task(self._poll())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_poller.wait(),
                                       HELD_POLL_SECONDS if self.held else POLL_SECONDS)
            self._wake_poller.clear()
            try:
                self._read_members()
                await asyncio.gather(self.prefill.refresh(), self.decode.refresh())
            except Exception:  # one odd reply must not stop health tracking for good
                log.exception("refreshing worker state failed; retrying")

    def _read_members(self) -> None:
        """Re-read the workers file; an unreadable one keeps the last membership (logged once
        per distinct problem, not every second)."""
        if self.workers_file is None:
            return
        try:
            members = parse_members(Path(self.workers_file).read_text())
        except (OSError, ValueError) as e:
            problem = f"workers file {self.workers_file}: {e}"
            if problem != self._members_error:
                log.warning("%s; keeping the last known workers", problem)
            self._members_error = problem
            return
        self._members_error = None
        self.prefill.set_listed(members["prefill"])
        self.decode.set_listed(members["decode"])

    # A worker is found through the pool of its home role (the list or DNS name it came
    # from) and used in its current role, as it reports it (docs/autoscaling.md).
    def decode_candidates(self) -> list[WorkerState]:
        return [*(w for w in self.decode.snapshot() if w.role != "prefill"),
                *(w for w in self.prefill.snapshot() if w.role in ("decode", "both"))]

    def prefill_candidates(self) -> list[WorkerState]:
        return [*(w for w in self.prefill.snapshot() if w.role not in ("decode", "both")),
                *(w for w in self.decode.snapshot() if w.role == "prefill")]

    def max_model_len(self, own: int) -> int:
        """The context a request may use: the router's own limit, or less where a worker
        reports less (it would refuse the rest). A router flag or model config that disagrees
        with the workers' --max-model-len then cannot admit prompts the workers refuse, nor
        default a chat's max_tokens past their context."""
        return min([own, *(w.max_model_len for pool in (self.prefill, self.decode)
                           for w in pool.snapshot() if w.max_model_len)])

    def pool_for(self, url: str) -> WorkerPool:
        """The pool that tracks a worker (its calls must go through it)."""
        return self.decode if url in self.decode else self.prefill

    def decode_ready(self) -> bool:
        return any(w.healthy for w in self.decode_candidates())

    def worker_ready(self) -> bool:
        """Any worker can serve a request whole (a prefill worker when no decode one is up)."""
        return self.decode_ready() or any(w.healthy for w in self.prefill.snapshot())

    async def any_ready(self) -> bool:
        await asyncio.gather(self.prefill.refresh(), self.decode.refresh())
        return self.worker_ready()

    async def hold_for_worker(self, rid: str) -> None:
        """Scale from zero: wait for a first ready worker rather than fail at once."""
        timeout = self.hold_timeout_seconds
        if timeout <= 0 or self.worker_ready():
            return
        log.info("request %s: no worker ready; holding it for up to %g s", rid, timeout)
        deadline = time.monotonic() + timeout
        self.held += 1
        self._wake_poller.set()  # poll now, and faster, while anything is held
        try:
            while not self.worker_ready():
                if time.monotonic() >= deadline:
                    raise api.APIError(
                        503, f"no worker became ready within {timeout:g} s (the service "
                        "is starting or scaled to zero); retry shortly", "service_unavailable")
                await asyncio.sleep(0.05)
        finally:
            self.held -= 1
