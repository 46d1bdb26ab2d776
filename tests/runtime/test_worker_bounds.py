"""Bounds on the worker's internal API, checked before any store lookup or engine work
(issue 15). Each request here was accepted before, and cost the worker far more than its
size: a replay of any length on the engine thread, a store read sized by an over-long prompt,
stop strings of any length, an unbounded queue, a 500 for deep JSON."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.serving.protocol import MAX_STOP, MAX_STOP_CHARS
from cleave.runtime.serving.worker import Worker


class CountingConnector:
    """Stands in for the KV store connector: counts the store lookups a request causes."""

    def __init__(self) -> None:
        self.lookups = 0
        self.store = type("S", (), {"keys": type("K", (), {"namespace": "t"})()})()

    async def load_prefix(self, ids: list[int]) -> None:
        self.lookups += 1


def _serve(tiny_model_dir: Path, check: Callable[[TestClient, Worker], Awaitable[None]],
           connector: Any = None, **worker_args: Any) -> None:
    async def run() -> None:
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                                    kv_cache_bytes=1 << 22),
                                       progress=lambda _: None))
        worker = Worker(engine, "both", connector, **worker_args)
        try:
            async with TestClient(TestServer(worker.app())) as client:
                await check(client, worker)
        finally:
            engine.shutdown()

    asyncio.run(run())


def _body(**fields: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}, **fields}


def test_earlier_tokens_beyond_max_tokens_are_refused(tiny_model_dir: Path) -> None:
    async def check(client: TestClient, _: Worker) -> None:
        r = await client.post("/internal/generate", json=_body(
            first_token=5, earlier_token_ids=[7] * 100_000))
        assert r.status == 400
        assert "earlier_token_ids" in (await r.json())["error"]["message"]

    _serve(tiny_model_dir, check)


def test_a_prompt_beyond_the_context_never_reaches_the_store(tiny_model_dir: Path) -> None:
    connector = CountingConnector()

    async def check(client: TestClient, worker: Worker) -> None:
        limit = worker.engine.engine.max_model_len
        r = await client.post("/internal/generate", json={
            "prompt_token_ids": [1] * (limit + 1000), "sampling": {"max_tokens": 1}})
        assert r.status == 400
        assert "maximum context" in (await r.json())["error"]["message"]
        assert connector.lookups == 0  # was 1: the lookup ran first, sized by the prompt

    _serve(tiny_model_dir, check, connector)


def test_stop_strings_are_bounded_in_count_and_length(tiny_model_dir: Path) -> None:
    async def check(client: TestClient, _: Worker) -> None:
        for stop in (["x"] * (MAX_STOP + 1), ["y" * (MAX_STOP_CHARS + 1)]):
            for path in ("/internal/generate", "/internal/prefill"):
                r = await client.post(path, json={"prompt_token_ids": [1, 2, 3],
                                                  "sampling": {"max_tokens": 2, "stop": stop}})
                assert r.status == 400, (path, len(stop))

    _serve(tiny_model_dir, check)


def test_deeply_nested_json_is_a_400(tiny_model_dir: Path) -> None:
    deep = "[" * 200_000 + "]" * 200_000

    async def check(client: TestClient, _: Worker) -> None:
        for path in ("/internal/generate", "/internal/prefill", "/internal/role"):
            r = await client.post(path, data=deep)
            assert r.status == 400, path

    _serve(tiny_model_dir, check)


def test_a_worker_beyond_its_open_requests_answers_503(tiny_model_dir: Path) -> None:
    async def check(client: TestClient, worker: Worker) -> None:
        long = await client.post("/internal/generate", json={
            "prompt_token_ids": [1, 2, 3],
            "sampling": {"max_tokens": 200, "ignore_eos": True}})
        assert long.status == 200
        await long.content.readline()  # streaming: it holds the one slot
        r = await client.post("/internal/generate", json=_body())
        assert r.status == 503
        assert "requests open" in (await r.json())["error"]["message"]
        r = await client.post("/internal/prefill", json=_body())
        assert r.status == 503
        long.close()
        for _ in range(100):  # the slot comes back once the aborted stream is closed
            if worker.admission.open == 0:
                break
            await asyncio.sleep(0.05)
        r = await client.post("/internal/generate", json=_body())
        assert r.status == 200
        lines = [json.loads(x) for x in (await r.text()).splitlines() if x]
        assert lines[-1]["finished"]

    _serve(tiny_model_dir, check, max_open_requests=1)
