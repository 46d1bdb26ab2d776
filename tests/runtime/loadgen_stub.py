"""The small real aiohttp server `cleave bench`'s client, runner and command are tested
against (tests/runtime/test_loadgen_client.py).

It runs on its own event loop in a thread, so that both the async client tests and the
in-process ``cleave bench`` runs (which start their own loop) can talk to it. Each path prefix
is one behaviour: ``/ok/v1/...`` streams with known delays, ``/e500/v1/...`` fails, etc.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from cleave.common import metric_names as names

FIRST_DELAY, GAP, CHUNKS = 0.3, 0.1, 4  # the /ok stream: first text after 0.3 s, then every 0.1 s
PROMPT_TOKENS = 64  # what /ok's usage says
SLOW_S = 0.3  # how long a /slow request takes


def stub_tokens(text: str) -> int:
    """The stub's tokenizer: a word of up to 4 characters is one token, a longer one two."""
    return sum(1 if len(w) <= 4 else 2 for w in text.split())


class Stub:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self.slow_first = 0  # /slowstart: this many more requests take a second to start


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def _data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def make_app(stub: Stub) -> web.Application:
    async def ok(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stub.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        resp = await _sse(request)
        if chat:  # a role-only chunk at once, as vLLM sends: it is not the first token
            await resp.write(_data({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
        await asyncio.sleep(FIRST_DELAY)
        for i in range(CHUNKS):
            if i:
                await asyncio.sleep(GAP)
            choice = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            await resp.write(_data({"choices": [choice]}))
        await resp.write(_data({"choices": [{"text": "", "finish_reason": "length"}]}))
        await resp.write(_data({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS,
                                                         "completion_tokens": CHUNKS}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def busy(request: web.Request, service_s: float = 0.05) -> web.StreamResponse:
        stub.bodies.append(await request.json())
        stub.in_flight += 1
        stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        try:
            await asyncio.sleep(service_s)
            resp = await _sse(request)
            await resp.write(_data({"choices": [{"text": "x"}]}))
            await resp.write(_data({"choices": [], "usage": {"prompt_tokens": 3,
                                                             "completion_tokens": 1}}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            stub.in_flight -= 1

    async def slow(request: web.Request) -> web.StreamResponse:
        return await busy(request, SLOW_S)

    async def slowstart(request: web.Request) -> web.StreamResponse:
        first = stub.slow_first > 0
        stub.slow_first -= 1
        return await busy(request, 1.0 if first else 0.05)

    async def e500(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine exploded"}}, status=500)

    async def bad(request: web.Request) -> web.StreamResponse:
        resp = await _sse(request)
        await resp.write(b"data: {not json\n\n")
        return resp

    async def nodone(request: web.Request) -> web.StreamResponse:
        resp = await _sse(request)
        await resp.write(_data({"choices": [{"text": "a"}]}))
        return resp  # ends cleanly, but without [DONE]

    async def inband(request: web.Request) -> web.StreamResponse:
        resp = await _sse(request)
        await resp.write(_data({"choices": [{"text": "a"}]}))
        await resp.write(_data({"error": {"message": "decode worker failed mid-response"}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def plain_json(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "whole"}]})

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}, {"id": "b"}]})

    async def tokenize(request: web.Request) -> web.Response:  # vLLM's /tokenize, in short
        body = await request.json()
        assert body["add_special_tokens"] is False and body["model"] == "stub-model"
        return web.json_response({"count": stub_tokens(body["prompt"])})

    async def workers(request: web.Request) -> web.Response:  # as Cleave's router lists them
        return web.json_response({"prefill": [{"url": f"{stub.url}/worker"}], "decode": []})

    async def worker_metrics(request: web.Request) -> web.Response:
        # Each request served so far read 2 blocks, one of them a decode handoff.
        n = len(stub.bodies)
        return web.Response(text=(
            f"{names.total(names.STORE_HITS)} {2 * n}\n"
            f"{names.total(names.KV_LOADED_BLOCKS)}{{purpose=\"decode\"}} {n}\n"))

    async def router_metrics(request: web.Request) -> web.Response:
        return web.Response(text=f"{names.total(names.ROUTING_DECISIONS)}"
                                 f'{{path="disaggregated",reason="long_prompt"}} '
                                 f"{len(stub.bodies)}\n")

    app = web.Application()
    for prefix, handler in (("ok", ok), ("busy", busy), ("e500", e500), ("bad", bad),
                            ("nodone", nodone), ("inband", inband), ("json", plain_json),
                            ("hang", hang), ("slow", slow), ("slowstart", slowstart)):
        app.router.add_post(f"/{prefix}/v1/completions", handler)
        app.router.add_post(f"/{prefix}/v1/chat/completions", handler)
        app.router.add_get(f"/{prefix}/v1/models", models)
        if prefix != "json":  # a server without vLLM's /tokenize
            app.router.add_post(f"/{prefix}/tokenize", tokenize)
    app.router.add_get("/ok/internal/workers", workers)
    app.router.add_get("/ok/metrics", router_metrics)
    app.router.add_get("/worker/metrics", worker_metrics)
    return app


@contextlib.contextmanager
def running_stub() -> Iterator[Stub]:
    """The stub server, listening on a free port (``Stub.url``) until the block ends."""
    s = Stub()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(s), shutdown_timeout=0.5)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    s.url = f"http://127.0.0.1:{port}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield s
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
