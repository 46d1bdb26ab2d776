"""``cleave worker``: one engine behind HTTP, in the prefill, decode or both role.

The internal API the router calls:

- ``POST /internal/prefill`` ``{request_id, prompt_token_ids, sampling}`` -> the first token;
  the prompt's full KV blocks are written to the block store on the way.
- ``POST /internal/generate`` ``{request_id, prompt_token_ids, sampling, first_token?,
  earlier_token_ids?}`` -> NDJSON lines of token deltas. With ``first_token`` it continues a
  prefilled request from the store's blocks; with ``earlier_token_ids`` too, a request whose
  decode worker died after handing those out (the router resumes it); without, it serves the
  whole request (reusing any cached prefix).
- ``GET /internal/stats``: load and KV usage for routing; ``/health``, ``/ready``, ``/metrics``.

On SIGTERM the worker reports not-ready, refuses new work, lets requests in flight finish for
up to the grace period, then exits. A client that goes away aborts its request and frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from cleave.runtime import metrics
from cleave.runtime.engine.async_engine import AsyncEngine, EngineDeadError, last_output
from cleave.runtime.engine.outputs import KVHandoff, RequestOutput
from cleave.runtime.engine.sequence import RequestError, SamplingParams
from cleave.runtime.kv_connector import KVBlocksMissing, KVStoreConnector

log = logging.getLogger("cleave.worker")
ROLES = ("prefill", "decode", "both")
ENGINE_CHECK_SECONDS = 0.5


_INT_FIELDS = ("max_tokens", "top_k")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sampling_from_json(data: Any) -> SamplingParams:
    """Strictly typed: a wrong type must fail here, not on the engine thread later."""
    if not isinstance(data, dict):
        raise RequestError("sampling must be an object")
    for k in _INT_FIELDS:
        if k in data and not _is_int(data[k]):
            raise RequestError(f"sampling.{k} must be an integer")
    for k in _OPTIONAL_INT_FIELDS:
        if data.get(k) is not None and not _is_int(data[k]):
            raise RequestError(f"sampling.{k} must be an integer or null")
    for k in _FLOAT_FIELDS:
        if k in data and (isinstance(data[k], bool) or not isinstance(data[k], int | float)):
            raise RequestError(f"sampling.{k} must be a number")
    checks: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
        ("stop", lambda v: isinstance(v, str), "strings"),
        ("stop_token_ids", _is_int, "integers"))
    for k, ok, kind in checks:
        if not _list_of(data.get(k, []), ok):
            raise RequestError(f"sampling.{k} must be a list of {kind}")
    if not isinstance(data.get("ignore_eos", False), bool):
        raise RequestError("sampling.ignore_eos must be true or false")
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in data.items()}
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise RequestError(f"bad sampling parameters: {e}") from None


def _list_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(ok(v) for v in value)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}},
                             status=status)


class Worker:
    def __init__(self, engine: AsyncEngine, role: str,
                 connector: KVStoreConnector | None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.engine = engine
        self.role = role
        self.connector = connector
        self.draining = False
        self.inflight = 0
        core = engine.engine
        metrics.RUNNING.labels(role).set_function(lambda: len(core.scheduler.running))
        metrics.WAITING.labels(role).set_function(lambda: len(core.scheduler.waiting))
        metrics.KV_USAGE.labels(role).set_function(core.kv_usage_ratio)
        # Exported from the start: a worker that has served nothing reports 0 tokens (idle),
        # not nothing (unknown), so an autoscaler can scale it down.
        metrics.PROMPT_TOKENS.labels(role)
        metrics.GENERATION_TOKENS.labels(role)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", metrics.metrics_endpoint)
        app.router.add_get("/internal/stats", self.stats)
        app.router.add_post("/internal/prefill", self.prefill)
        app.router.add_post("/internal/generate", self.generate)
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
        return web.json_response({
            "role": self.role, "running": len(core.scheduler.running),
            "waiting": len(core.scheduler.waiting), "inflight": self.inflight,
            "kv_usage": core.kv_usage_ratio(),
            "draining": self.draining or self.engine.dead is not None,
            "max_model_len": core.max_model_len,
            # What a router needs to ask the store how much of a prompt is cached.
            "kv_root_hash": core.root_hash.hex(), "block_size": core.config.block_size,
            "kv_namespace": self.connector.store.keys.namespace if self.connector else None})

    # -- work ----------------------------------------------------------------------------
    async def _parse(self, request: web.Request) -> tuple[str, list[int], SamplingParams,
                                                          dict[str, Any]]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        ids = body.get("prompt_token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise RequestError("prompt_token_ids must be a list of integers")
        rid = str(body.get("request_id") or f"w-{time.monotonic_ns()}")
        return rid, ids, sampling_from_json(body.get("sampling", {})), body

    async def prefill(self, request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "worker is draining")
        if self.role == "decode":
            return _error(400, "this is a decode worker")
        try:
            rid, ids, params, _ = await self._parse(request)
        except RequestError as e:
            return _error(400, str(e))
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
        handoff = out.handoff
        assert handoff is not None and handoff.first_token is not None
        return web.json_response({
            "request_id": rid, "first_token": handoff.first_token, "text": out.new_text,
            "num_prompt_tokens": out.num_prompt_tokens,
            "num_cached_tokens": out.num_cached_tokens,
            "num_blocks": len(handoff.block_hashes)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return _error(503, "worker is draining")
        if self.role == "prefill":
            return _error(400, "this is a prefill worker")
        start = time.perf_counter()
        try:
            rid, ids, params, body = await self._parse(request)
            first = body.get("first_token")
            if first is not None and not _is_int(first):
                raise RequestError("first_token must be an integer")
            earlier = body.get("earlier_token_ids") or []
            if not _list_of(earlier, _is_int):
                raise RequestError("earlier_token_ids must be a list of integers")
            if earlier and first is None:
                raise RequestError("earlier_token_ids needs first_token")
            recompute = body.get("kv_load_failure_policy", "recompute") != "fail"
            stream = await self._stream(rid, ids, params, first, tuple(earlier), recompute)
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
            while out is not None:
                now = time.perf_counter()
                if out.new_token_ids:
                    if n == 0 and first is None:
                        metrics.TTFT.labels(self.role).observe(now - start)
                    elif n:
                        metrics.TPOT.labels(self.role).observe(now - last)
                    n += len(out.new_token_ids)
                    last = now
                await response.write(_line(out))
                if out.finished:
                    metrics.E2E.labels(self.role).observe(now - start)
                    metrics.GENERATION_TOKENS.labels(self.role).inc(out.num_output_tokens)
                    if first is None:  # a prefilled request's prompt was counted there
                        metrics.PROMPT_TOKENS.labels(self.role).inc(out.num_prompt_tokens)
                    metrics.REQUESTS.labels(self.role, str(out.finish_reason)).inc()
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
        cached = await self.connector.load_prefix(ids) if self.connector else None
        return self.engine.generate(ids, params, request_id=rid, kv=cached)

    async def drain(self, grace_seconds: float) -> None:
        self.draining = True
        deadline = time.monotonic() + grace_seconds
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("grace period over with %d requests in flight", self.inflight)


def _line(out: RequestOutput) -> bytes:
    record: dict[str, Any] = {
        "token_ids": out.new_token_ids, "text": out.new_text, "finished": out.finished,
        "finish_reason": str(out.finish_reason) if out.finish_reason else None,
        "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
        "cached_tokens": out.num_cached_tokens}
    if out.new_logprobs:
        record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                               "top": [list(t) for t in lp.top]} for lp in out.new_logprobs]
    return json.dumps(record).encode() + b"\n"


async def serve(worker: Worker, host: str, port: int, grace_seconds: float) -> int:
    """Serve until SIGTERM/SIGINT, then drain within ``grace_seconds`` and stop; returns the
    process exit code (1: the engine died, and the worker must be restarted)."""
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
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
