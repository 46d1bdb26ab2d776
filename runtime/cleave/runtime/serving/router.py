"""``cleave router``: the OpenAI-compatible API in front of prefill and decode workers.

Per request: tokenize (and apply the chat template), pick the path (conditional
disaggregation), run the prefill on a prefill worker chosen by prefix affinity and load, then
stream the decode from the decode worker with the most free KV capacity. A prefill worker that
fails means the decode worker serves the whole request; a decode worker that fails before its
first token means another one is tried; one that fails mid-stream ends the response with a
clear error. A client that disconnects cancels the upstream request, which frees its KV.

Scale from zero: with a hold timeout set, a request that finds no decode worker ready waits for
one (counted in ``cleave_num_requests_waiting{role="router"}``, the demand an autoscaler reads
to wake a role at zero) instead of failing, and gets a 503 with Retry-After if none turns ready
in time. The model stays listed throughout.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

from cleave.kv_store.block_hash import chain_hashes
from cleave.kv_store.keys import KeySpace
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.kv_store.redis_store import RedisBlockStore
from cleave.kv_store.store import StoreUnavailable
from cleave.runtime import metrics
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving import responses
from cleave.runtime.serving.fleet import Fleet
from cleave.runtime.serving.openapi import openapi_document
from cleave.runtime.serving.resume import continuation, rebased
from cleave.runtime.serving.routing import (
    PathChoice,
    choose_decode,
    choose_path,
    choose_prefill,
)
from cleave.runtime.serving.upstream import WorkerRejected, WorkerUnavailable

log = logging.getLogger("cleave.router")
REQUEST_ID = web.RequestKey("request_id", str)


@dataclass(frozen=True)
class RouterConfig:
    model: str
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    disaggregate_min_tokens: int = 64  # shorter prompts skip the separate prefill
    kv_load_failure_policy: str = "recompute"  # or "fail": refuse rather than recompute
    request_timeout_seconds: float = 300.0
    worker_idle_timeout_seconds: float = 30.0  # longest silence from a streaming worker
    max_concurrent_requests: int = 256  # beyond this: 429 with Retry-After
    api_key: str | None = None
    # The workers' block store: lets the router see how much of a prompt is cached already.
    redis_url: str | None = None
    redis_password: str | None = None
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    # Membership that changes at run time (``cleave up --autoscale``): see membership.py.
    workers_file: str | None = None
    # Scale from zero: how long a request may wait for a first ready decode worker. 0: fail
    # at once with 503, as a router with fixed workers should.
    hold_timeout_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.decode_urls and self.workers_file is None:
            raise ValueError("the router needs at least one decode (or both-role) worker, "
                             "or a workers file")
        if self.hold_timeout_seconds < 0:
            raise ValueError("hold_timeout_seconds must be >= 0")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Any, max_model_len: int,
                 vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.active = 0
        self.fleet = Fleet(config.prefill_urls, config.decode_urls, config.workers_file,
                           config.hold_timeout_seconds)
        self.session: aiohttp.ClientSession | None = None
        self._store: RedisBlockStore | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", metrics.metrics_endpoint)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/internal/workers", self.workers)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession()
        await self.fleet.start(self.session)

    def _prefix_key(self, ids: list[int]) -> bytes:
        """The prompt's first block hash: prompts sharing it share a prefill worker's cache."""
        identity = self.fleet.decode.kv_identity or self.fleet.prefill.kv_identity
        if identity is not None and len(ids) >= identity[1]:
            root, block_size, _ = identity
            return chain_hashes(bytes.fromhex(root), ids[:block_size], block_size)[0]
        return str(ids[:16]).encode()

    async def _cached_tokens(self, ids: list[int]) -> int:
        """How many leading prompt tokens the store already holds (0 when it cannot say)."""
        identity = self.fleet.decode.kv_identity
        if self.config.redis_url is None or identity is None:
            return 0
        root, block_size, namespace = identity
        if self._store is None or self._store.keys.namespace != namespace:
            self._store = RedisBlockStore(
                KeySpace(namespace, bytes.fromhex(root)),
                RedisStoreConfig(url=self.config.redis_url, password=self.config.redis_password,
                                 timeout_seconds=0.2))
        hashes = chain_hashes(bytes.fromhex(root), ids[:len(ids) - 1], block_size)
        try:
            return block_size * await self._store.longest_cached_prefix(hashes)
        except StoreUnavailable:
            return 0

    async def _stop(self, _: web.Application) -> None:
        self.fleet.stop()
        if self._store is not None:
            await self._store.close()
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request[REQUEST_ID] = rid
        try:
            if request.path.startswith(("/v1/", "/internal/")):
                self._authorize(request)
            response: web.StreamResponse = await handler(request)
        except api.APIError as e:
            headers = {"X-Request-Id": rid}
            if e.status in (429, 503):
                headers["Retry-After"] = "1"
            log.info("request %s -> %d %s", rid, e.status, e.message)
            return web.json_response(e.body(), status=e.status, headers=headers)
        except web.HTTPException as e:
            err = api.APIError(e.status, e.reason or "error")
            return web.json_response(err.body(), status=e.status, headers={"X-Request-Id": rid})
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

    def _authorize(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):  # constant time
            raise api.APIError(401, "missing or invalid API key", "authentication_error",
                               code="invalid_api_key")

    # -- plain endpoints -----------------------------------------------------------------
    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(responses.models_list([self.config.model], int(time.time())))

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if await self.fleet.decode.any_ready():
            return web.json_response({"status": "ready"})
        if self.config.hold_timeout_seconds > 0:
            # Scaled to zero is a normal state: taking requests (and holding them) is what
            # wakes the workers, so the router must stay in its Service's endpoints.
            return web.json_response({"status": "ready (holding requests until a decode "
                                                "worker is ready)"})
        return web.json_response({"status": "no decode worker ready"}, status=503)

    async def workers(self, _: web.Request) -> web.Response:
        """The router's view of its workers: what ``cleave up`` waits on before it stops one."""
        return web.json_response({"prefill": self.fleet.prefill.describe(),
                                  "decode": self.fleet.decode.describe(), "held": self.fleet.held})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document([self.config.model]))

    # -- generation ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = api.parse_completion_request(await _json(request), [self.config.model])
        prompt = parsed.prompt
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False)) \
            if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise api.APIError(400, f"token ids must be in [0, {self.vocab_size})",
                               param="prompt")
        params = parsed.sampling_params(self.config.default_completion_max_tokens)
        return await self._serve(request, ids, params, parsed.stream, parsed.include_usage,
                                 chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = api.parse_chat_request(await _json(request), [self.config.model])
        text = self.tokenizer.apply_chat_template(parsed.template_messages(), tokenize=False,
                                                  add_generation_prompt=True)
        ids = list(self.tokenizer.encode(str(text), add_special_tokens=False))
        params = parsed.sampling_params(max(1, self.max_model_len - len(ids)))
        return await self._serve(request, ids, params, parsed.stream, parsed.include_usage,
                                 chat=True)

    async def _serve(self, request: web.Request, ids: list[int], params: SamplingParams,
                     stream: bool, include_usage: bool, chat: bool) -> web.StreamResponse:
        if not ids:
            raise api.APIError(400, "the prompt is empty", param="prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise api.APIError(
                400, f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"more than this model's context of {self.max_model_len} tokens",
                param="max_tokens", code="context_length_exceeded")
        if self.active >= self.config.max_concurrent_requests:
            raise api.APIError(429, "too many requests in flight; retry shortly",
                               "rate_limit_exceeded")
        self.active += 1
        try:
            rid = str(request[REQUEST_ID])
            # Client-chosen ids may repeat; the workers get one that cannot collide.
            events = self._generate(f"{rid}-{uuid.uuid4().hex[:8]}", ids, params)
            want_lps = params.logprobs is not None
            if stream:
                writer = responses.StreamWriter(rid, self.config.model, chat, include_usage,
                                                self._token_text, want_lps)
                return await _stream(request, events, writer, rid)
            lines = [line async for line in events]
            return web.json_response(responses.final_response(
                rid, self.config.model, chat, lines, self._token_text, want_lps))
        finally:
            self.active -= 1

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    async def _generate(self, rid: str, ids: list[int],
                        params: SamplingParams) -> AsyncIterator[dict[str, Any]]:
        cfg = self.config
        await self.fleet.hold_for_decode(rid)
        sampling = asdict(params)
        cached = await self._cached_tokens(ids) if len(ids) >= cfg.disaggregate_min_tokens else 0
        path = choose_path(len(ids), cached, bool(self.fleet.prefill), cfg.disaggregate_min_tokens)
        if params.logprobs is not None:
            path = PathChoice(False, "logprobs")  # served whole: one place computes them all
        first: int | None = None
        start = time.perf_counter()
        if path.disaggregate:
            worker = choose_prefill(self.fleet.prefill.snapshot(), self._prefix_key(ids))
            if worker is None:
                path = PathChoice(False, "no_prefill_worker")
            else:
                try:
                    res = await self.fleet.prefill.prefill(
                        worker.url, {"request_id": rid, "prompt_token_ids": ids,
                                     "sampling": sampling}, cfg.request_timeout_seconds)
                except WorkerUnavailable as e:
                    log.warning("request %s: %s; serving it decode-only", rid, e)
                    path = PathChoice(False, "prefill_failed")
                except WorkerRejected as e:
                    raise api.APIError(400, str(e)) from None
                else:
                    first = int(res["first_token"])
                    metrics.TTFT.labels("router").observe(time.perf_counter() - start)
                    yield {"text": res.get("text", ""), "token_ids": [first], "finished": False}
        metrics.ROUTING_DECISIONS.labels(
            "disaggregated" if first is not None else "decode_only", path.reason).inc()
        payload = {"request_id": rid, "prompt_token_ids": ids, "sampling": sampling,
                   "first_token": first, "kv_load_failure_policy": cfg.kv_load_failure_policy}
        # Tokens the client has. A decode worker that dies mid-stream is resumed on another
        # one from there (resume.py): the last token sent goes in as the first token, as a
        # prefill's does, and the ones before it as output already handed out.
        sent: list[int] = [first] if first is not None else []
        handed = len(sent)
        cached_tokens = 0
        tried: set[str] = set()
        while True:
            worker = choose_decode(self.fleet.decode.snapshot(), frozenset(tried))
            if worker is None:
                if len(sent) > handed:
                    raise api.APIError(502, "the decode worker failed mid-response and no "
                                       "other could continue it", "server_error",
                                       code="worker_failed")
                raise api.APIError(503, "no decode worker is available", "service_unavailable")
            tried.add(worker.url)
            resumed = len(sent) > handed
            attempt = continuation(payload, sent) if resumed else payload
            try:
                async for line in self.fleet.decode.generate(worker.url, attempt,
                                                       cfg.request_timeout_seconds,
                                                       cfg.worker_idle_timeout_seconds):
                    if not sent and line.get("token_ids"):
                        metrics.TTFT.labels("router").observe(time.perf_counter() - start)
                    if resumed:
                        line = rebased(line, cached_tokens)
                    else:
                        cached_tokens = int(line.get("cached_tokens", cached_tokens))
                    sent.extend(line.get("token_ids") or [])
                    yield line
                metrics.E2E.labels("router").observe(time.perf_counter() - start)
                return
            except WorkerRejected as e:
                if e.status == 424:  # KV missing under policy "fail"
                    raise api.APIError(503, str(e), "service_unavailable") from None
                raise api.APIError(400, str(e)) from None
            except WorkerUnavailable as e:
                if len(sent) > handed:
                    log.warning("request %s: %s after %d tokens; resuming it on another "
                                "decode worker", rid, e, len(sent))
                else:
                    log.warning("request %s: %s; trying another decode worker", rid, e)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise api.APIError(400, "the request body is not valid JSON") from None


async def _stream(request: web.Request, events: AsyncIterator[dict[str, Any]],
                  writer: responses.StreamWriter, rid: str) -> web.StreamResponse:
    """SSE: nothing is sent until the first token, so early failures are ordinary errors."""
    response: web.StreamResponse | None = None
    try:
        async for line in events:
            if response is None:
                response = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                    "X-Request-Id": rid})
                await response.prepare(request)
            for chunk in writer.chunks(line):
                await response.write(chunk)
    except api.APIError as e:
        if response is None:
            raise
        await response.write(responses.sse(e.body()))  # headers are gone: error goes in-band
    assert response is not None
    await response.write(responses.SSE_DONE)
    await response.write_eof()
    return response
