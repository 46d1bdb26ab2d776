"""Router failure paths against a stub decode worker that breaks on cue (narrow, in-process)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from stub_worker_support import stub_worker_app
from transformers import AutoTokenizer

from cleave.runtime.serving.router import Router, RouterConfig
from cleave.runtime.serving.wire import GenerateRequest


def _line(text: str, finished: bool = False) -> bytes:
    return json.dumps({"token_ids": [5], "text": text, "finished": finished,
                       "finish_reason": "length" if finished else None, "prompt_tokens": 3,
                       "completion_tokens": 1, "cached_tokens": 0}).encode() + b"\n"


def stub_worker(behaviour: str) -> web.Application:
    """``midstream``: one token, then the connection drops; ``early``: one token, then a
    clean end of the response without a ``finished`` line; ``refuse``: 503 at once."""
    async def generate(request: web.Request) -> web.StreamResponse:
        if behaviour == "refuse":
            return web.json_response({"error": {"message": "busy"}}, status=503)
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(_line("Hello"))
        if behaviour == "early":
            await response.write_eof()  # a well-formed end: only the missing last line tells
            return response
        assert request.transport is not None
        request.transport.close()  # the worker dies mid-response
        return response

    return stub_worker_app(generate)


@pytest.fixture
async def router_for(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    servers: list[TestServer] = []
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(*behaviours: str) -> TestClient[web.Request, web.Application]:
        urls = []
        for b in behaviours:
            server = TestServer(stub_worker(b))
            await server.start_server()
            servers.append(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        config = RouterConfig(model="tiny", decode_urls=tuple(urls),
                              worker_idle_timeout_seconds=2.0)
        router = Router(config, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 512, 512)
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()
    for s in servers:
        await s.close()


async def _sse(client: TestClient[web.Request, web.Application]) -> list[str]:
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi there", "max_tokens": 5, "stream": True})
    assert response.status == 200
    return [line.decode().strip() async for line in _lines(response.content)
            if line.strip()]


async def _lines(content: object) -> AsyncIterator[bytes]:
    async for line in content:  # type: ignore[attr-defined]
        yield line


async def test_a_decode_worker_dying_mid_stream_ends_the_sse_with_an_error(router_for) -> None:  # type: ignore[no-untyped-def]
    events = await _sse(await router_for("midstream"))
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hello"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "mid-response" in error["message"] and error["type"] == "server_error"
    assert error["code"] == "worker_failed"  # retryable: a client need not parse the message
    assert events[-1] == "data: [DONE]"


async def test_a_stream_ended_without_its_last_line_is_an_error_not_a_short_answer(
        router_for, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("WARNING", logger="cleave.router")
    events = await _sse(await router_for("early"))
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hello"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "worker_failed" and "mid-response" in error["message"]
    assert events[-1] == "data: [DONE]"
    # No chunk claims the request finished: the client was not handed a short answer as whole.
    finishes = [c["finish_reason"] for e in events[:-2]
                for c in json.loads(e.removeprefix("data: "))["choices"]]
    assert finishes == [None], finishes
    assert any("ended the stream early" in r.getMessage() for r in caplog.records)


async def test_no_decode_worker_able_to_serve_is_a_503_with_retry_after(router_for) -> None:  # type: ignore[no-untyped-def]
    client = await router_for("refuse", "refuse")
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert response.status == 503
    assert response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["type"] == "service_unavailable"


async def test_a_worker_leaving_and_rejoining_rotation_is_logged_once_each(
        caplog: pytest.LogCaptureFixture) -> None:
    import aiohttp

    from cleave.runtime.serving.upstream import WorkerPool

    state = {"answer": True, "draining": False}

    async def stats(_: web.Request) -> web.Response:
        if not state["answer"]:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"kv_usage": 0.0, "waiting": 0, "draining": state["draining"]})

    app = web.Application()
    app.router.add_get("/internal/stats", stats)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    caplog.set_level("INFO", logger="cleave.router")
    try:
        async with aiohttp.ClientSession() as session:
            pool = WorkerPool([url], session)
            for answer, draining in [(True, False), (True, False), (False, False),
                                     (False, False), (True, False), (True, True)]:
                state.update(answer=answer, draining=draining)
                await pool.refresh()
    finally:
        await server.close()
    said = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    # Listed workers start in rotation, so the first flip is the first time it fails.
    assert said == [f"worker {url} is out of rotation: no answer to /internal/stats",
                    f"worker {url} is ready",
                    f"worker {url} is out of rotation: draining"]


def flaky_worker(shared: dict[str, Any]) -> web.Application:
    """The first generate call made to any worker sharing ``shared`` sends two tokens and
    dies; later calls record their body and finish the request with two more."""
    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"kv_usage": 0.0, "waiting": 0, "draining": False})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse()
        await response.prepare(request)
        shared["calls"] += 1
        if shared["calls"] == 1:
            await response.write(_line("Hello"))
            await response.write(_line(" there"))
            assert request.transport is not None
            request.transport.close()
            return response
        shared["continued"] = body
        n = len(body["prompt_token_ids"])
        done = len(body["earlier_token_ids"]) + 1  # a worker counts what it was handed
        for i, (text, finished) in enumerate(((" world", False), ("!", True))):
            await response.write(json.dumps({
                "token_ids": [6], "text": text, "finished": finished,
                "finish_reason": "length" if finished else None, "prompt_tokens": n,
                "completion_tokens": done + i + 1, "cached_tokens": n}).encode() + b"\n")
        return response

    app = web.Application()
    app.router.add_get("/internal/stats", stats)
    app.router.add_post("/internal/generate", generate)
    return app


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_worker_dying_mid_stream_is_resumed_on_another(
        tiny_model_dir: Path, stream: bool) -> None:
    shared: dict[str, Any] = {"calls": 0}
    servers = [TestServer(flaky_worker(shared)) for _ in range(2)]
    for server in servers:
        await server.start_server()
    urls = tuple(str(s.make_url("")).rstrip("/") for s in servers)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    router = Router(RouterConfig(model="tiny", decode_urls=urls), tokenizer, 512, 512)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        response = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi there", "max_tokens": 5, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None})
        assert response.status == 200
        if stream:
            events = [json.loads(line.decode().removeprefix("data: "))
                      async for line in _lines(response.content)
                      if line.strip() and line.strip() != b"data: [DONE]"]
            assert not any("error" in e for e in events)
            text = "".join(c["text"] for e in events for c in e["choices"])
            usage = events[-1]["usage"]
        else:
            body = await response.json()
            text, usage = body["choices"][0]["text"], body["usage"]
    finally:
        await client.close()
        for server in servers:
            await server.close()
    prompt = tokenizer("hi there")["input_ids"]
    assert text == "Hello there world!"  # one response, nothing lost or repeated
    continued = GenerateRequest.model_validate_json(json.dumps(shared["continued"]))  # as read
    assert continued.prompt_token_ids == prompt  # the same request ...
    assert continued.earlier_token_ids == [5]  # ... holding what the client has as output
    assert continued.first_token == 5  # the last one sent goes on from there
    assert continued.sampling.max_tokens == 5
    assert continued.kv_load_failure_policy == "recompute"
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == 4
    # What the request found cached, not what its continuation found (the blocks it saved).
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
