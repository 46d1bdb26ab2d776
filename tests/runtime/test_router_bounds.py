"""The router's own bounds (issue 15): deep JSON is a 400 in the OpenAI error shape, not a 500
from the parser's RecursionError; stop strings longer than MAX_STOP_CHARS are refused before
any tokenization or worker call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from cleave.runtime.serving.protocol import MAX_STOP_CHARS
from cleave.runtime.serving.router import Router, RouterConfig


def test_deep_json_and_long_stop_strings_are_400s(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # No worker listens there: every answer below comes from the router's own checks.
    router = Router(RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",)),
                    tokenizer, 512, 512)

    async def run() -> None:
        async with TestClient(TestServer(router.app())) as client:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = await client.post(path, data="[" * 200_000 + "]" * 200_000)
                assert r.status == 400, path
                assert (await r.json())["error"]["type"] == "invalid_request_error"
            r = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "stop": ["z" * (MAX_STOP_CHARS + 1)]})
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "stop"

    asyncio.run(run())


def test_a_body_trickled_in_too_slowly_is_a_408(tiny_model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a client sending its body a byte at a time held a concurrency slot for ever."""
    from cleave.runtime.serving import router as router_module

    monkeypatch.setattr(router_module, "BODY_READ_SECONDS", 0.5)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    router = Router(RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",)),
                    tokenizer, 512, 512)

    async def run() -> None:
        async with TestClient(TestServer(router.app())) as client:
            reader, writer = await asyncio.open_connection(client.host, client.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            assert status.split()[1] == b"408"

    asyncio.run(run())


def test_admission_comes_before_tokenizing_and_tokenizing_is_off_the_event_loop(
        tiny_model_dir: Path) -> None:
    """Before, the router tokenized (and applied the chat template) on its event loop and only
    then checked its limit: an overloaded router spent its CPU on prompts it would refuse, and
    a slow prompt stalled every probe and stream it served. Here one request is held inside
    the tokenizer: the event loop still answers, and a second request gets its 429 without
    reaching the tokenizer."""
    import threading

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    router = Router(RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",),
                                 max_concurrent_requests=1), tokenizer, 512, 512)
    release, calls = threading.Event(), []
    text_ids = router.prompts.text_ids

    def slow_text_ids(prompt: object, *args: object, **kwargs: object) -> list[int]:
        calls.append(prompt)
        assert release.wait(30)
        return text_ids(prompt, *args, **kwargs)  # type: ignore[arg-type]

    router.prompts.text_ids = slow_text_ids  # type: ignore[method-assign]

    async def run() -> None:
        async with TestClient(TestServer(router.app())) as client:
            held = asyncio.create_task(client.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 2}))
            while not calls:
                await asyncio.sleep(0.01)
            health = await asyncio.wait_for(client.get("/health"), 5)  # the loop is free
            assert health.status == 200
            refused = await client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi " * 10_000}]})
            assert refused.status == 429
            assert (await refused.json())["error"]["type"] == "rate_limit_exceeded"
            tokenize = await client.post("/tokenize", json={"prompt": "hi"})
            assert tokenize.status == 429  # vLLM's /tokenize takes a slot and the same thread
            assert len(calls) == 1  # the refused prompts never reached the tokenizer
            assert not held.done()  # it has the slot, inside the tokenizer
            release.set()
            held.cancel()  # no worker listens: what it gets next is not this test's

    asyncio.run(run())
