"""``cleave worker``: one engine behind HTTP, in the prefill, decode or both role.

The internal API the router calls:

- ``POST /internal/prefill`` ``{request_id, prompt_token_ids, sampling}`` -> the first token;
  the prompt's full KV blocks are written to the block store on the way.
- ``POST /internal/generate`` ``{request_id, prompt_token_ids, sampling, first_token?,
  earlier_token_ids?}`` -> NDJSON lines of token deltas. With ``first_token`` it continues a
  prefilled request from the store's blocks; with ``earlier_token_ids`` too, a request whose
  decode worker died after handing those out (the router resumes it); without, it serves the
  whole request (reusing any cached prefix). Every role serves it: a prefill worker gets
  whole requests when no decode worker is healthy. A decode worker refuses prefills.
- ``POST /internal/role`` ``{role: prefill|decode}``: a live flip of the current role (the home
  role stays; worker_role.py). ``GET /internal/stats`` reports both.
- ``GET /internal/stats``: load and KV usage for routing; ``/health``, ``/ready``, ``/metrics``.

Every path but ``/health``, ``/ready`` and ``/metrics`` needs the service's internal token as a
Bearer key when one is configured (internal_auth.py).

On SIGTERM the worker reports not-ready, refuses new work, lets requests in flight finish for
up to the grace period, then exits. A client that goes away aborts its request and frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from cleave.common.settings import HttpSettings
from cleave.runtime import engine_metrics, metrics
from cleave.runtime.engine.async_engine import AsyncEngine, EngineDeadError, last_output
from cleave.runtime.engine.outputs import KVHandoff, RequestOutput
from cleave.runtime.engine.sequence import RequestError, SamplingParams, TokenLogprob
from cleave.runtime.kv_connector import KVBlocksMissing, KVStoreConnector
from cleave.runtime.serving import http_server
from cleave.runtime.serving.internal_auth import require_token
from cleave.runtime.serving.protocol import BODY_READ_SECONDS
from cleave.runtime.serving.wire import (
    ErrorDetail,
    ErrorReply,
    GenerateRequest,
    LineLogprob,
    PrefillReply,
    PrefillRequest,
    RoleReply,
    RoleRequest,
    TokenLine,
    WorkerStats,
    describe,
)
from cleave.runtime.serving.worker_limits import (
    Admission,
    Saturated,
    check_earlier,
    check_request,
)
from cleave.runtime.serving.worker_role import RoleError, WorkerRoles, check_flip

log = logging.getLogger("cleave.worker")
Message = TypeVar("Message", bound=BaseModel)
Work = TypeVar("Work", bound=PrefillRequest)
ENGINE_CHECK_SECONDS = 0.5


def _error(status: int, message: str) -> web.Response:
    return _reply(ErrorReply(error=ErrorDetail(message=message)), status)


def _reply(message: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=message.model_dump_json(), status=status,
                        content_type="application/json")


class Worker:
    def __init__(self, engine: AsyncEngine, role: str,
                 connector: KVStoreConnector | None, internal_token: str | None = None,
                 max_open_requests: int = 1024, model_name: str | None = None) -> None:
        self.engine = engine
        # vllm:* series carry the name clients use (vLLM's served name, default the model).
        metrics.serve_as(model_name or engine.engine.config.model)
        self.internal_token = internal_token  # required on /internal/* when set
        self.admission = Admission(max_open_requests)
        self.connector = connector
        self.draining = False
        self.inflight = 0
        core = engine.engine
        self.roles = WorkerRoles(role, {
            metrics.RUNNING: lambda: len(core.scheduler.running),
            metrics.WAITING: lambda: len(core.scheduler.waiting),
            metrics.KV_USAGE: core.kv_usage_ratio})
        engine_metrics.bind_engine(core)

    @property
    def role(self) -> str:
        """The current role (a flip changes it; the home role is ``roles.home``)."""
        return self.roles.current

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20,
                              middlewares=[require_token(self.internal_token)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", metrics.metrics_endpoint)
        app.router.add_get("/internal/stats", self.stats)
        app.router.add_post("/internal/prefill", self.prefill)
        app.router.add_post("/internal/generate", self.generate)
        app.router.add_post("/internal/role", self.flip)
        return app

    # -- probes --------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        if self.engine.dead is not None:  # let Kubernetes restart us
            return web.json_response({"status": f"engine stopped: {self.engine.dead!r}"},
                                     status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if self.engine.dead is not None:
            return web.json_response({"status": "engine stopped"}, status=503)
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        store = "none"
        if self.connector is not None:
            problem = await self.store_problem()
            # The store is a cache: without it requests recompute, so the worker stays ready.
            store = "ok" if problem is None else f"unavailable (recomputing): {problem}"
        return web.json_response({"status": "ready", "role": self.role, "store": store})

    async def store_problem(self) -> str | None:
        """Why the KV store cannot serve (e.g. a refused password), or None when it can."""
        return await self.connector.store.problem() if self.connector else None

    async def stats(self, _: web.Request) -> web.Response:
        core = self.engine.engine
        return _reply(WorkerStats(
            role=self.roles.current, home_role=self.roles.home, flips=self.roles.flips,
            running=len(core.scheduler.running), waiting=len(core.scheduler.waiting),
            inflight=self.inflight, kv_usage=core.kv_usage_ratio(),
            draining=self.draining or self.engine.dead is not None,
            max_model_len=core.max_model_len, kv_root_hash=core.root_hash.hex(),
            block_size=core.config.block_size,
            kv_namespace=self.connector.store.keys.namespace if self.connector else None))

    # -- work ----------------------------------------------------------------------------
    async def _parse(self, request: web.Request, kind: type[Work]) -> tuple[str, Work]:
        message = await _read(request, kind)
        check_request(len(message.prompt_token_ids), message.sampling,
                      self.engine.engine.max_model_len)
        return message.request_id or f"w-{time.monotonic_ns()}", message

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            with self.admission.admit():
                return await self._prefill(request)
        except Saturated as e:  # the router serves it elsewhere, as for any failed prefill
            return _error(503, str(e))

    async def _prefill(self, request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "worker is draining")
        if self.role == "decode":
            # 503, not 400: after a flip the router may not know yet; it serves the request
            # whole elsewhere, as for any failed prefill.
            return _error(503, "this is a decode worker")
        try:
            rid, asked = await self._parse(request, PrefillRequest)
        except RequestError as e:
            return _error(400, str(e))
        ids, params = asked.prompt_token_ids, asked.sampling
        self.inflight += 1
        start = time.perf_counter()
        try:
            if self.connector is not None:
                out = await self.connector.prefill(ids, params, request_id=rid)
            else:
                out = await last_output(self.engine.generate(ids, params, request_id=rid,
                                                       prefill_only=True))
        except RequestError as e:
            return _error(400, str(e))
        except EngineDeadError as e:  # the router tries another worker; this one exits soon
            return _error(503, str(e))
        finally:
            self.inflight -= 1
        metrics.TTFT.labels(self.role).observe(time.perf_counter() - start)
        metrics.PROMPT_TOKENS.labels(self.role).inc(out.num_prompt_tokens)
        engine_metrics.record_visit(self.role, out, prefilled=False, prefill_only=True)
        handoff = out.handoff
        assert handoff is not None and handoff.first_token is not None
        return _reply(PrefillReply(
            request_id=rid, first_token=handoff.first_token, text=out.new_text,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            num_blocks=len(handoff.block_hashes),
            prompt_logprobs=None if out.prompt_logprobs is None
            else _wire(out.prompt_logprobs)))

    async def flip(self, request: web.Request) -> web.Response:
        """``POST /internal/role {"role": "prefill"|"decode"}``: change the current role at once.
        Work in flight finishes here; new work follows the role the router reads in stats."""
        try:
            role = (await _read(request, RoleRequest)).role
            check_flip(self.roles.home, self.draining)
        except RequestError as e:
            return _error(400, f"the body must be {{\"role\": \"prefill\" or \"decode\"}}: {e}")
        except RoleError as e:
            return _error(e.status, str(e))
        before = self.roles.flip(role)
        if before != role:
            log.info("role %s -> %s (home role %s)", before, role, self.roles.home)
        return _reply(RoleReply(role=role, previous=before, home_role=self.roles.home))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            with self.admission.admit():  # held while the answer streams
                return await self._generate(request)
        except Saturated as e:  # the router tries another worker
            return _error(503, str(e))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return _error(503, "worker is draining")
        # A prefill worker serves whole requests too: the router sends it those when no
        # decode worker is healthy (every worker holds the whole model; see dispatch.py).
        start = time.perf_counter()
        try:
            rid, asked = await self._parse(request, GenerateRequest)
            ids, params, first = asked.prompt_token_ids, asked.sampling, asked.first_token
            check_earlier(len(asked.earlier_token_ids), params)
            recompute = asked.kv_load_failure_policy != "fail"
            stream = await self._stream(rid, ids, params, first,
                                        tuple(asked.earlier_token_ids), recompute)
            head = await anext(stream)  # validation errors surface before any byte is sent
        except RequestError as e:
            return _error(400, str(e))
        except KVBlocksMissing as e:
            # 424: this request's dependency failed, not the worker; the router says 503.
            return _error(424, str(e))
        except EngineDeadError as e:
            return _error(503, str(e))
        self.inflight += 1
        last = start
        n = 0
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            out: RequestOutput | None = head
            tpot = metrics.TPOT.labels(self.role)  # once, not per token: a twin's lookups lock
            while out is not None:
                now = time.perf_counter()
                if out.new_token_ids:
                    if n == 0 and first is None:
                        metrics.TTFT.labels(self.role).observe(now - start)
                    elif n:
                        tpot.observe(now - last)
                    n += len(out.new_token_ids)
                    last = now
                await response.write(_line(out))
                if out.finished:
                    metrics.E2E.labels(self.role).observe(now - start)
                    engine_metrics.record_finished(self.role, out, params.max_tokens,
                                                   prefilled=first is not None)
                    break
                out = await anext(stream, None)
        finally:
            self.inflight -= 1
            await stream.aclose()  # a vanished client aborts the request and frees its KV
        await response.write_eof()
        return response

    async def _stream(self, rid: str, ids: list[int], params: SamplingParams,
                      first: int | None, earlier: tuple[int, ...], recompute: bool
                      ) -> AsyncGenerator[RequestOutput, None]:
        if first is not None:
            if self.connector is not None:
                return self.connector.decode(ids, params, first, request_id=rid,
                                             recompute_missing=recompute,
                                             earlier_tokens=earlier)
            if not recompute:
                raise KVBlocksMissing("no KV store is configured and the policy is 'fail'")
            handoff = KVHandoff(block_hashes=[], blocks=[], first_token=first,
                                earlier_tokens=earlier)
            return self.engine.generate(ids, params, request_id=rid, kv=handoff)
        cached = await self.connector.load_prefix(ids, params.cache_salt) \
            if self.connector and params.reads_cached_prefix else None
        return self.engine.generate(ids, params, request_id=rid, kv=cached)

    async def drain(self, grace_seconds: float) -> None:
        self.draining = True
        deadline = time.monotonic() + grace_seconds
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("grace period over with %d requests in flight", self.inflight)


async def _read(request: web.Request, kind: type[Message]) -> Message:
    """The body as the wire message it must be (wire.py); RequestError for anything else, a
    deeply nested document and a body not read within BODY_READ_SECONDS included."""
    try:
        async with asyncio.timeout(BODY_READ_SECONDS):
            body = await request.read()
    except TimeoutError:
        raise RequestError("the body was not read in time") from None
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(describe(e)) from None


def _wire(lps: list[TokenLogprob]) -> list[LineLogprob]:
    return [LineLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top),
                        rank=lp.rank) for lp in lps]


def _line(out: RequestOutput) -> bytes:
    line = TokenLine(
        token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
        finish_reason=str(out.finish_reason) if out.finish_reason else None,
        prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens, logprobs=_wire(out.new_logprobs),
        prompt_logprobs=None if out.prompt_logprobs is None else _wire(out.prompt_logprobs))
    # Logprobs are written only when there are some: most lines have none.
    unset = ({"logprobs"} if not out.new_logprobs else set()) | \
        ({"prompt_logprobs"} if out.prompt_logprobs is None else set())
    return line.model_dump_json(exclude=unset or None).encode() + b"\n"


async def serve(worker: Worker, host: str, port: int, grace_seconds: float,
                http: HttpSettings, sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM/SIGINT (on ``host:port``, or ``sock`` when cleave up bound it),
    then drain within ``grace_seconds`` and stop; returns the process exit code (1: the
    engine died, and the worker must be restarted)."""
    runner = await http_server.start(worker.app(), host, port, http, sock)
    log.info("%s worker listening on http://%s:%d", worker.role, host, port)
    problem = await worker.store_problem()
    if problem is not None:  # said once up front: a wrong password is not a per-request surprise
        log.warning("the KV store is unavailable (%s); requests recompute until it answers",
                    problem)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), ENGINE_CHECK_SECONDS)
        if worker.engine.dead is not None and not stop.is_set():
            # A dead engine fails every request: exit, so that cleave up (or Kubernetes)
            # restarts the worker, rather than live on answering 503s.
            log.error("the engine stopped (%r); exiting", worker.engine.dead)
            await runner.cleanup()
            return 1
    log.info("draining (grace %.0f s)", grace_seconds)
    await worker.drain(grace_seconds)
    await runner.cleanup()
    worker.engine.shutdown()
    return 0
