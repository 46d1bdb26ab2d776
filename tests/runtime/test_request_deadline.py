"""One deadline per request across the router's retries: workers that go silent, or that
stream too slowly to finish, cannot stretch a request past ``--request-timeout``.

Real HTTP: the router's app on a port, the official ``openai`` client, and stub workers that
answer their stats but then hang on a request (silent) or trickle tokens (slow).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from transformers import AutoTokenizer

from cleave.runtime.serving.router import Router, RouterConfig

TIMEOUT = 3.0  # the request's whole budget
IDLE = 2.0  # longest silence accepted from a worker
WORKERS = 3  # each silent one costs IDLE: 6 s in all, twice the budget, without a deadline


def _worker(behaviour: str) -> web.Application:
    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"kv_usage": 0.0, "waiting": 0, "draining": False})

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        await response.prepare(request)
        if behaviour == "slow":  # a token every second: never silent, never done
            while True:
                await response.write(json.dumps({
                    "token_ids": [5], "text": "a", "finished": False, "prompt_tokens": 3,
                    "completion_tokens": 1, "cached_tokens": 0}).encode() + b"\n")
                await asyncio.sleep(1.0)
        await asyncio.sleep(3600)  # silent: headers sent, then nothing (a frozen engine)
        return response

    app = web.Application()
    app.router.add_get("/internal/stats", stats)
    app.router.add_post("/internal/generate", generate)
    return app


Serve = Callable[[str], Awaitable[str]]


@pytest.fixture
async def router_url(tiny_model_dir: Path) -> AsyncIterator[Serve]:
    servers: list[TestServer] = []

    async def serve(behaviour: str) -> str:
        urls = []
        for _ in range(WORKERS):
            server = TestServer(_worker(behaviour))
            await server.start_server()
            servers.append(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        config = RouterConfig(model="tiny", decode_urls=tuple(urls),
                              request_timeout_seconds=TIMEOUT,
                              worker_idle_timeout_seconds=IDLE)
        router = Router(config, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 512, 512)
        server = TestServer(router.app())
        await server.start_server()
        servers.append(server)
        return str(server.make_url("/v1"))

    yield serve
    for s in reversed(servers):
        await s.close()


async def test_silent_workers_share_one_deadline(router_url: Serve) -> None:
    client = openai.AsyncOpenAI(base_url=await router_url("silent"), api_key="-",
                                max_retries=0, timeout=60)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failed:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
    took = time.monotonic() - start
    assert TIMEOUT - 0.1 < took < TIMEOUT + 2.0, took  # without the deadline: 6 s and 9 s
    assert failed.value.status_code == 504
    assert failed.value.code == "request_timeout"  # type: ignore[attr-defined]


async def test_a_slow_stream_ends_at_the_deadline(router_url: Serve) -> None:
    client = openai.AsyncOpenAI(base_url=await router_url("slow"), api_key="-",
                                max_retries=0, timeout=60)
    start = time.monotonic()
    stream = await client.completions.create(model="tiny", prompt="hi", max_tokens=100,
                                             stream=True)
    with pytest.raises(openai.APIError) as failed:  # the error comes in-band, after tokens
        async for _ in stream:
            pass
    took = time.monotonic() - start
    assert TIMEOUT - 0.1 < took < TIMEOUT + 2.0, took  # without the deadline: 6 s and 9 s
    assert "limit" in str(failed.value)
    # The request's time ran out, not the worker's: it streamed all along, so it stays in
    # rotation (marked down, it would turn away every request for its cooldown).
    root = str(stream.response.url).split("/v1/")[0]
    async with aiohttp.ClientSession() as session, \
            session.get(root + "/internal/workers") as r:
        workers = (await r.json())["decode"]
    assert len(workers) == WORKERS and all(w["healthy"] for w in workers), workers
