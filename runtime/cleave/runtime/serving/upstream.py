"""The router's view of its workers: health, load, and the internal HTTP calls to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.http_exceptions import LineTooLong
from pydantic import ValidationError

from cleave.runtime.serving.routing import WorkerState, updated_rate
from cleave.runtime.serving.wire import (
    GenerateRequest,
    PrefillReply,
    PrefillRequest,
    TokenLine,
    WorkerStats,
    error_message,
    prompt_scores_bytes,
)

log = logging.getLogger("cleave.router")
DOWN_COOLDOWN_SECONDS = 2.0


class WorkerUnavailable(RuntimeError):
    """A worker failed to answer (connection refused or reset, timeout, 5xx)."""


class WorkerRejected(ValueError):
    """A worker refused the request itself (4xx), or answered what no worker should (502):
    retrying elsewhere would not help."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class PrefillSpeed:
    """Observed prefill speed (seconds per prompt token, queueing included), shared by the
    pools (a flipped worker's prefills count too): what the router predicts TTFT from."""

    seconds_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        self.seconds_per_token = updated_rate(self.seconds_per_token, seconds, tokens)


@dataclass
class _Tracked:
    state: WorkerState
    down_until: float = 0.0
    # Gone from discovery while requests are still open on it: it gets no new ones, and the
    # pool forgets it once they finish (a drain, as seen from the router).
    leaving: bool = False
    refused: bool = False  # its last poll answered 401: said once, not every second


class WorkerPool:
    """Workers from a static list, from DNS for ``dns+http://host:port`` entries, and from a
    list the router sets with :meth:`set_listed` (the workers file of ``cleave up``).

    A DNS entry (a Kubernetes headless Service) is re-resolved on every refresh, so pods
    that come and go as a role scales are picked up without any Kubernetes API access.
    """

    def __init__(self, urls: Sequence[str], session: aiohttp.ClientSession,
                 speed: PrefillSpeed | None = None) -> None:
        self.session = session
        self.speed = speed or PrefillSpeed()
        self._static = {u.rstrip("/") for u in urls if not u.startswith("dns+")}
        self._dns = {u.removeprefix("dns+").rstrip("/"): set[str]() for u in urls
                     if u.startswith("dns+")}
        self._listed: set[str] = set()
        self._workers = {u: _Tracked(WorkerState(u)) for u in self._static}
        # (root hash hex, block size, namespace) of the workers' KV blocks, once one says.
        self.kv_identity: tuple[str, int, str] | None = None

    def __bool__(self) -> bool:
        return bool(self._workers or self._dns)

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    def _reconcile(self, known: set[str], found: set[str]) -> set[str]:
        """Add what one discovery source found, retire what it lost; returns what it now owns.
        A new worker counts as down until its first poll answers; a lost one that still has
        requests open stays tracked (but gets no new ones) until they finish."""
        for url in found:
            if url not in self._workers:
                self._workers[url] = _Tracked(WorkerState(url, healthy=False))
            self._workers[url].leaving = False
        owned = set(found)
        for url in known - found:
            tracked = self._workers.get(url)
            if tracked is None or url in self._static:
                continue
            if tracked.state.inflight == 0:
                del self._workers[url]
            else:
                tracked.leaving = True
                owned.add(url)  # still streaming: drop it on a later pass
        return owned

    def set_listed(self, urls: Sequence[str]) -> None:
        self._listed = self._reconcile(self._listed, {u.rstrip("/") for u in urls})

    async def _discover(self) -> None:
        loop = asyncio.get_running_loop()
        for template, known in self._dns.items():
            parts = urlsplit(template)
            port = parts.port or 80
            try:
                infos = await loop.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
            except OSError:
                continue  # resolver trouble: keep the last known set
            found = set()
            for family, *_, address in infos:
                host = f"[{address[0]}]" if family == socket.AF_INET6 else str(address[0])
                found.add(f"{parts.scheme}://{host}:{port}")
            self._dns[template] = self._reconcile(known, found)

    def describe(self) -> list[dict[str, Any]]:
        """What the router knows of each worker, for ``GET /internal/workers``."""
        now = time.monotonic()
        return [{"url": u, "healthy": t.state.healthy and now >= t.down_until and not t.leaving,
                 "inflight": t.state.inflight, "queued_tokens": t.state.queued_tokens,
                 "leaving": t.leaving, "role": t.state.role}
                for u, t in sorted(self._workers.items())]

    def snapshot(self) -> list[WorkerState]:
        now = time.monotonic()
        return [replace(t.state, healthy=t.state.healthy and now >= t.down_until
                        and not t.leaving)
                for t in self._workers.values()]

    def mark_down(self, url: str) -> None:
        self._workers[url].down_until = time.monotonic() + DOWN_COOLDOWN_SECONDS

    @contextlib.contextmanager
    def track(self, url: str, tokens: int = 0) -> Any:
        t = self._workers[url]
        t.state = replace(t.state, inflight=t.state.inflight + 1,
                          queued_tokens=t.state.queued_tokens + tokens)
        try:
            yield
        finally:
            t.state = replace(t.state, inflight=t.state.inflight - 1,
                              queued_tokens=t.state.queued_tokens - tokens)

    async def refresh(self) -> None:
        """Re-resolve DNS entries, then poll every worker's /internal/stats (bounded); a
        silent worker is unhealthy."""
        await self._discover()
        async def one(url: str, tracked: _Tracked) -> None:
            try:
                async with self.session.get(url + "/internal/stats",
                                            timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    stats = WorkerStats.model_validate_json(await r.read()) \
                        if r.status == 200 else None
                    refused = r.status == 401  # a token that differs from the worker's
            except (aiohttp.ClientError, TimeoutError, ValidationError):
                stats, refused = None, False
            if stats is None or stats.draining:
                if tracked.state.healthy or (refused and not tracked.refused):  # flips only
                    log.warning("worker %s is out of rotation: %s", url,
                                "draining" if stats else "it refused the internal token"
                                if refused else "no answer to /internal/stats")
                tracked.state = replace(tracked.state, healthy=False)
                tracked.refused = refused
                return
            tracked.refused = False
            if not tracked.state.healthy:
                log.info("worker %s is ready", url)
            if stats.kv_namespace and stats.kv_root_hash and stats.block_size:
                self.kv_identity = (stats.kv_root_hash, stats.block_size, stats.kv_namespace)
            role = stats.role
            if role != tracked.state.role and tracked.state.role is not None:
                log.info("worker %s is now in the %s role", url, role)
            tracked.state = replace(tracked.state, healthy=True, kv_usage=stats.kv_usage,
                                    waiting=stats.waiting, role=role,
                                    max_model_len=stats.max_model_len or None)

        await asyncio.gather(*(one(u, t) for u, t in self._workers.items()))

    # -- calls ---------------------------------------------------------------------------
    async def prefill(self, url: str, payload: PrefillRequest, timeout: float) -> PrefillReply:
        tokens = len(payload.prompt_token_ids)
        ahead = self._workers[url].state.queued_tokens
        start = time.monotonic()
        with self.track(url, tokens):
            try:
                async with self.session.post(url + "/internal/prefill", data=_encode(payload),
                                             headers=_JSON,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    body = await r.read()
                    status = r.status
                reply = PrefillReply.model_validate_json(body) if status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValidationError) as e:
                if not (isinstance(e, TimeoutError) and _budget_spent(start, timeout)):
                    self.mark_down(url)
                raise WorkerUnavailable(f"prefill worker {url}: {type(e).__name__}") from None
        if 400 <= status < 500:
            raise WorkerRejected(error_message(body))
        if reply is None:
            self.mark_down(url)
            raise WorkerUnavailable(f"prefill worker {url} answered {status}")
        self.speed.observe(time.monotonic() - start, ahead + tokens)
        return reply

    async def generate(self, url: str, payload: GenerateRequest, timeout: float,
                       idle_timeout: float) -> AsyncIterator[TokenLine]:
        """The worker's NDJSON lines; ends with a ``finished`` line or raises.

        ``idle_timeout`` bounds the gap between lines: a worker that dies mid-stream is
        noticed within it, and the caller is never left waiting.
        """
        start = time.monotonic()
        with self.track(url):
            try:
                async with self.session.post(
                        url + "/internal/generate", data=_encode(payload), headers=_JSON,
                        timeout=aiohttp.ClientTimeout(total=timeout,
                                                      sock_read=idle_timeout)) as r:
                    if 400 <= r.status < 500:
                        raise WorkerRejected(error_message(await r.read()), r.status)
                    if r.status != 200:
                        raise WorkerUnavailable(f"decode worker {url} answered {r.status}")
                    # A line may hold the prompt's scores: allowed their size beyond the
                    # reader's usual bound, which they would overrun.
                    limit = r.content.get_read_buffer_limits()[1] + prompt_scores_bytes(payload)
                    while raw := await r.content.readline(max_line_length=limit):
                        if not raw.strip():
                            continue
                        line = TokenLine.model_validate_json(raw)
                        yield line
                        if line.finished:
                            return
            except LineTooLong:  # more than the request asks for: a bug, not a worker down
                log.error("decode worker %s sent a line over %d bytes", url, limit)
                raise WorkerRejected("the worker's reply was too long to read", 502) from None
            except (aiohttp.ClientError, TimeoutError, ValidationError) as e:
                if not (isinstance(e, TimeoutError) and _budget_spent(start, timeout)):
                    self.mark_down(url)
                raise WorkerUnavailable(f"decode worker {url}: {type(e).__name__}") from None
            self.mark_down(url)
            raise WorkerUnavailable(f"decode worker {url} ended the stream early")


_JSON = {"Content-Type": "application/json"}


def _encode(message: PrefillRequest) -> bytes:
    """Fields at their defaults are left out: a worker of the previous release (a rolling
    upgrade rolls the routers first) then reads every request that uses nothing new, and one
    that does (a ``cache_salt``) is refused by name, never served without it."""
    return message.model_dump_json(exclude_defaults=True).encode()


def _budget_spent(start: float, timeout: float) -> bool:
    """Whether a timed-out call used up the time it was given: the request's deadline ran
    out (deadline.py), which says nothing of the worker, so it is not marked down."""
    return time.monotonic() - start >= timeout - 0.01
