"""``cleave router``: the OpenAI-compatible API in front of prefill and decode workers.

Per request: tokenize (and apply the chat template), pick the path (conditional
disaggregation), run the prefill on a prefill worker chosen by prefix affinity and load, then
stream the decode from the decode worker with the most free KV capacity (dispatch.py). A
prompt whose prefill would wait past the TTFT target behind the prefill workers' backlog is
served whole by a decode worker; with no decode worker healthy, a prefill worker serves the
request whole. A prefill worker that fails means the request is served whole; a worker that
fails before its first token means another one is tried; one that fails mid-stream is resumed
on another from the tokens sent, or the response ends with a clear error. A client that
disconnects cancels the upstream request, which frees its KV.

Scale from zero: with a hold timeout set, a request that finds no worker ready waits for
one (counted in ``cleave_num_requests_waiting{role="router"}``, the demand an autoscaler reads
to wake a role at zero) instead of failing, and gets a 503 with Retry-After if none turns ready
in time. The model stays listed throughout.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from aiohttp import web

from cleave.common.settings import DEFAULT_MAX_PROMPT_SCORES
from cleave.kv_store.redis_config import RedisStoreConfig
from cleave.runtime import metrics
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving import chat_models, choices, replies, responses, tools
from cleave.runtime.serving import protocol as api
from cleave.runtime.serving.admission import Admission
from cleave.runtime.serving.deadline import Deadline
from cleave.runtime.serving.dispatch import decode_stream
from cleave.runtime.serving.fleet import Fleet
from cleave.runtime.serving.internal_auth import bearer
from cleave.runtime.serving.logprobs import PromptScores
from cleave.runtime.serving.openapi import openapi_json
from cleave.runtime.serving.prompt_cache import PromptCache
from cleave.runtime.serving.protocol import BODY_READ_SECONDS
from cleave.runtime.serving.response_models import StatusResponse
from cleave.runtime.serving.routing import (
    PathChoice,
    choose_path,
    choose_prefill,
    predicted_prefill_seconds,
)
from cleave.runtime.serving.upstream import WorkerRejected, WorkerUnavailable
from cleave.runtime.serving.vllm_api import Prompts, VllmEndpoints
from cleave.runtime.serving.wire import (
    GenerateRequest,
    KVLoadFailurePolicy,
    PrefillRequest,
    TokenLine,
)

log = logging.getLogger("cleave.router")
REQUEST_ID = web.RequestKey("request_id", str)


@dataclass(frozen=True)
class RouterConfig:
    model: str  # the first served name: what responses and the vllm:* metrics carry
    aliases: tuple[str, ...] = ()  # more names a request may ask for (vLLM's later names)
    model_source: str = ""  # what the model was loaded from: /v1/models' "root", as vLLM's
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    disaggregate_min_tokens: int = 64  # shorter prompts skip the separate prefill
    kv_load_failure_policy: str = "recompute"  # or "fail": refuse rather than recompute
    request_timeout_seconds: float = 300.0
    worker_idle_timeout_seconds: float = 30.0  # longest silence from a streaming worker
    max_concurrent_requests: int = 256  # beyond this: 429 with Retry-After
    api_key: str | None = None
    # The workers' key: sent as a Bearer header on every call to them (internal_auth.py).
    internal_token: str | None = None
    # The workers' block store: lets the router see how much of a prompt is cached already.
    redis_store: RedisStoreConfig | None = None
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    # Membership that changes at run time (``cleave up --autoscale``): see membership.py.
    workers_file: str | None = None
    # Scale from zero: how long a request may wait for a first ready decode worker. 0: fail
    # at once with 503, as a router with fixed workers should.
    hold_timeout_seconds: float = 0.0
    # A long prompt whose prefill would finish later than this (the prefill workers' backlog
    # at their observed speed) is served whole by a decode worker instead. None: never.
    ttft_target_seconds: float | None = None
    # How the model writes tool calls (tools.PARSER_CHOICES); auto: from its chat template.
    tool_call_parser: str = tools.AUTO
    # usage.prompt_tokens_details.cached_tokens in responses; False: null (docs/operations.md,
    # Security model: it says whether others sent the same prefix).
    show_cached_tokens: bool = True
    # The most prompt logprobs one response may carry (PromptScores.check_size): a 400 beyond.
    max_prompt_scores: int = DEFAULT_MAX_PROMPT_SCORES

    def __post_init__(self) -> None:
        if not self.decode_urls and self.workers_file is None:
            raise ValueError("the router needs at least one decode (or both-role) worker, "
                             "or a workers file")
        if self.hold_timeout_seconds < 0:
            raise ValueError("hold_timeout_seconds must be >= 0")
        if self.max_prompt_scores < 0:
            raise ValueError("max_prompt_scores must be >= 0")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")
        if self.tool_call_parser not in tools.PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {tools.PARSER_CHOICES}")

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may ask for, the first one first (as /v1/models lists them)."""
        return tuple(dict.fromkeys((self.model, *self.aliases)))  # each once, in order


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Any, max_model_len: int,
                 vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._max_model_len = max_model_len  # its own: the flag, or the model's config
        self.vocab_size = vocab_size
        self.prompts = Prompts(tokenizer, lambda: self.max_model_len, vocab_size)
        self.tool_parser = tools.resolve_parser(config.tool_call_parser,
                                                getattr(tokenizer, "chat_template", None))
        self.admission = Admission(config.max_concurrent_requests)
        metrics.serve_as(config.model)  # before Fleet binds the router's waiting gauge
        metrics.ROUTER_IN_FLIGHT.set_function(lambda: self.admission.active)
        self.fleet = Fleet(config.prefill_urls, config.decode_urls, config.workers_file,
                           config.hold_timeout_seconds)
        self.session: aiohttp.ClientSession | None = None
        self.cache = PromptCache(self.fleet, config.redis_store)

    @property
    def max_model_len(self) -> int:
        """The router's own context limit, or the workers' where they report less."""
        return self.fleet.max_model_len(self._max_model_len)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[metrics.count_requests, self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", metrics.metrics_endpoint)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/internal/workers", self.workers)
        VllmEndpoints(self.prompts, self.config.served_names, _json,
                      self.admission).register(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        # Every call this session makes goes to a worker, so it carries the workers' key.
        token = self.config.internal_token
        self.session = aiohttp.ClientSession(headers=bearer(token) if token else None)
        await self.fleet.start(self.session)

    async def _stop(self, _: web.Application) -> None:
        self.fleet.stop()
        self.admission.close()
        await self.cache.close()
        if self.session is not None:
            await self.session.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request[REQUEST_ID] = rid
        try:
            if request.path.startswith(("/v1/", "/internal/", "/tokenize", "/detokenize")):
                self._authorize(request)
            response: web.StreamResponse = await handler(request)
        except ConnectionResetError:
            raise  # the client left while its answer was written: nobody to tell
        except Exception as e:  # every answer in OpenAI's shape, a bug's too (logged there)
            return replies.error_reply(e, rid)
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
        return responses.json_reply(responses.models_list(
            self.config.served_names, int(time.time()), self.max_model_len,
            self.config.model_source or self.config.model))

    async def health(self, _: web.Request) -> web.Response:
        return responses.json_reply(StatusResponse(status="ok"))

    async def ready(self, _: web.Request) -> web.Response:
        if await self.fleet.any_ready():
            return responses.json_reply(StatusResponse(status="ready"))
        if self.config.hold_timeout_seconds > 0:
            # Scaled to zero is a normal state: taking requests (and holding them) is what
            # wakes the workers, so the router must stay in its Service's endpoints.
            return responses.json_reply(StatusResponse(
                status="ready (holding requests until a worker is ready)"))
        return responses.json_reply(StatusResponse(status="no worker ready"), 503)

    async def workers(self, _: web.Request) -> web.Response:
        """The router's view of its workers: what ``cleave up`` waits on before it stops one."""
        return web.json_response({"prefill": self.fleet.prefill.describe(),
                                  "decode": self.fleet.decode.describe(), "held": self.fleet.held})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.Response(body=openapi_json(self.config.served_names),
                            content_type="application/json")

    # -- generation ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = api.parse_completion_request(await _json(request),
                                              self.config.served_names)
        with self.admission.slot():  # before any tokenizing: a refused request costs nothing
            # With the BOS, as vLLM's.
            ids = await self.admission.off_loop(self.prompts.text_ids, parsed.prompt)
            params = parsed.sampling_params(self.config.default_completion_max_tokens)
            echo = ""
            if parsed.echo:  # the prompt as sent; token ids as their text
                echo = parsed.prompt if isinstance(parsed.prompt, str) else \
                    str(self.tokenizer.decode(list(parsed.prompt)))
            return await self._serve(request, ids, params, parsed, chat=False, echo=echo)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = api.parse_chat_request(await _json(request), self.config.served_names)
        with self.admission.slot():
            plan = tools.plan(parsed.tool_request, self.tool_parser)
            ids = await self.admission.off_loop(
                self.prompts.chat_ids, parsed.template_messages(),
                tools=parsed.tool_request.template_tools() if parsed.tool_request else None,
                suffix=tools.generation_suffix(parsed.tool_request, self.tool_parser))
            context = self.max_model_len
            params = tools.constrain(
                parsed.sampling_params(max(1, context - len(ids))), parsed.tool_request,
                self.tool_parser)
            echo = chat_models.continued(parsed.messages) if parsed.echo else ""
            return await self._serve(request, ids, params, parsed, chat=True, echo=echo,
                                     plan=plan)

    async def _serve(self, request: web.Request, ids: list[int], params: SamplingParams,
                     parsed: api.CompletionRequest | api.ChatRequest, chat: bool,
                     echo: str = "", plan: tools.ToolPlan | None = None) -> web.StreamResponse:
        if not ids:
            raise api.APIError(400, "the prompt is empty", param="prompt")
        context = self.max_model_len  # the workers' where they report less than the flag
        if len(ids) + params.max_tokens > context:
            raise api.APIError(
                400, f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"more than this model's context of {context} tokens",
                param="max_tokens", code="context_length_exceeded")
        api.check_token_ids(params, self.vocab_size)
        rid = str(request[REQUEST_ID])
        # Client-chosen ids may repeat; the workers get one that cannot collide.
        tag = f"{rid}-{uuid.uuid4().hex[:8]}"
        count, ranked = parsed.sequences, parsed.sequences > parsed.n
        sequences = [choices.child_params(params, i, ranked) for i in range(count)]
        events = choices.merged(lambda i: self._generate(
            tag if count == 1 else f"{tag}-{i}", ids, sequences[i]), count)
        streams = plan.stream if plan is not None else None
        want_lps = params.logprobs is not None
        prompt = None if params.prompt_logprobs is None else PromptScores(
            ids[0], parsed.prompt_logprobs, parsed.echo_logprobs)
        if prompt is not None:  # before any worker is called: a 400 when there are too many
            # A chat response carries the scores once; a completion, once per choice.
            prompt.check_size(len(ids), 1 if chat else parsed.n, self.config.max_prompt_scores)
        body_id = ("chatcmpl-" if chat else "cmpl-") + rid  # vLLM's and OpenAI's prefixes
        if parsed.stream:  # never ranked: protocol refuses best_of > n streamed
            writer = responses.StreamWriter(body_id, self.config.model, chat,
                                            parsed.include_usage, self._token_text,
                                            want_lps, choices=count, echo=echo,
                                            tools=streams, prompt=prompt)
            return await replies.stream(request, events, writer, rid, self.admission)
        lines: list[list[TokenLine]] = [[] for _ in range(count)]
        async for index, line in events:
            lines[index].append(line)
            if prompt is not None:
                prompt.take(line)  # sequence 0's, which ranking may leave out
        if ranked:
            lines = choices.best(lines, parsed.n)
        def reply() -> web.Response:
            return responses.json_reply(responses.final_response(
                body_id, self.config.model, chat, lines, self._token_text, want_lps, echo,
                streams, prompt))
        if prompt is None:  # small: the tokenizer thread is the other requests' TTFT
            return reply()
        return await self.admission.off_loop(reply)  # prompt scores: seconds at the limit

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    async def _generate(self, rid: str, ids: list[int],
                        params: SamplingParams) -> AsyncGenerator[TokenLine, None]:
        cfg = self.config
        await self.fleet.hold_for_worker(rid)
        deadline = Deadline.after(cfg.request_timeout_seconds)  # every attempt shares it
        start = time.perf_counter()
        first: int | None = None
        path = await self._choose_path(ids, params)
        if path.disaggregate:
            worker = choose_prefill(self.fleet.prefill_candidates(),
                                    self.cache.prefix_key(ids, params.cache_salt))
            assert worker is not None  # _choose_path saw one
            try:
                res = await self.fleet.pool_for(worker.url).prefill(
                    worker.url, PrefillRequest(request_id=rid, prompt_token_ids=ids,
                                               sampling=params), deadline.remaining())
            except WorkerUnavailable as e:
                log.warning("request %s: %s; serving it decode-only", rid, e)
                path = PathChoice(False, "prefill_failed")
            except WorkerRejected as e:
                raise api.APIError(400, str(e)) from None
            else:
                first = res.first_token
                metrics.TTFT.labels("router").observe(time.perf_counter() - start)
                yield TokenLine(text=res.text, token_ids=[first],
                                prompt_logprobs=res.prompt_logprobs)
        metrics.ROUTING_DECISIONS.labels(
            "disaggregated" if first is not None else
            "prefill_only" if path.reason == "no_decode_worker" else "decode_only",
            path.reason).inc()
        payload = GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=params,
                                  first_token=first,
                                  kv_load_failure_policy=cast(  # checked in RouterConfig
                                      KVLoadFailurePolicy, cfg.kv_load_failure_policy))
        async for line in decode_stream(self.fleet, rid, payload,
                                        [first] if first is not None else [], start,
                                        deadline, cfg.worker_idle_timeout_seconds):
            if not cfg.show_cached_tokens:  # then the usage has no prompt_tokens_details
                line = line.model_copy(update={"cached_tokens": None})
            yield line

    async def _choose_path(self, ids: list[int], params: SamplingParams) -> PathChoice:
        """Disaggregate or not (routing.choose_path), from what the store holds of the prompt
        and when the best prefill worker would get to it."""
        cfg = self.config
        if params.logprobs is not None:
            return PathChoice(False, "logprobs")  # served whole: one place computes them all
        if not self.fleet.decode_ready():
            return PathChoice(False, "no_decode_worker")  # a prefill worker serves it whole
        worker = None
        candidates = self.fleet.prefill_candidates()
        if candidates or self.fleet.prefill:
            worker = choose_prefill(candidates, self.cache.prefix_key(ids, params.cache_salt))
            if worker is None:
                return PathChoice(False, "no_prefill_worker")
        # A request that may not read cached KV computes its whole prompt wherever it goes.
        cached = await self.cache.cached_tokens(ids, params.cache_salt) \
            if len(ids) >= cfg.disaggregate_min_tokens and params.reads_cached_prefix else 0
        predicted = None if worker is None else predicted_prefill_seconds(
            worker, len(ids) - cached, self.fleet.speed.seconds_per_token)
        return choose_path(len(ids), cached, worker is not None, cfg.disaggregate_min_tokens,
                           predicted, cfg.ttft_target_seconds,
                           0 if worker is None else worker.queued_tokens)


async def _json(request: web.Request) -> Any:
    try:
        # A body trickled in byte by byte would hold its concurrency slot for ever.
        async with asyncio.timeout(BODY_READ_SECONDS):
            return await request.json()
    except TimeoutError:
        raise api.APIError(408, "the request body was not sent in time") from None
    except (ValueError, RecursionError):  # deep nesting exhausts the parser's stack: a 400
        raise api.APIError(400, "the request body is not valid JSON") from None
