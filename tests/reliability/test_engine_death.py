"""A worker whose engine loop dies exits (code 1), so ``cleave up`` or Kubernetes restarts it.

Before, such a worker lived on answering every request with an error: one request that broke
the sampler took a single-decode-worker deployment down for good (found by test_fuzz_http).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from redis_servers import free_port

from cleave.common.settings import HttpSettings
from cleave.runtime.engine.async_engine import AsyncEngine
from cleave.runtime.serving.worker import Worker, serve


async def test_a_worker_whose_engine_dies_exits_to_be_restarted(
        tiny_engine_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncEngine(tiny_engine_factory())
    port = free_port()
    serving = asyncio.create_task(serve(Worker(engine, "both", None), "127.0.0.1", port, 1.0,
                                        HttpSettings()))
    url = f"http://127.0.0.1:{port}"
    body = {"request_id": "r1", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 4}}
    async with aiohttp.ClientSession() as session:
        for _ in range(100):  # until it listens
            try:
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)

        def broken() -> list[Any]:
            raise RuntimeError("simulated device fault")

        monkeypatch.setattr(engine.engine, "step", broken)
        async with session.post(url + "/internal/generate", json=body) as r:
            assert r.status == 503 and "engine loop stopped" in (await r.json())["error"][
                "message"]
        async with session.get(url + "/health") as r:
            assert r.status == 503
        async with session.get(url + "/ready") as r:
            assert r.status == 503
        async with session.get(url + "/internal/stats") as r:
            assert (await r.json())["draining"] is True  # the router takes it out of rotation
        async with session.post(url + "/internal/prefill", json=body) as r:
            assert r.status == 503
    assert await asyncio.wait_for(serving, 10) == 1  # the process's exit code
