"""A decode worker, or Redis, that freezes (SIGSTOP) instead of dying, under load.

A frozen process keeps its sockets open: nothing resets, nothing closes, and only the router's
idle timeout (the longest silence it accepts from a streaming worker) notices. Two real decode
workers behind an in-process router whose idle timeout is short; streams in flight on both
when one freezes. Every stream must end within the idle timeout plus the time the other
worker takes to finish it, whole and with the reference text (resumed, not repeated or cut),
and a new request must be served while the worker stays frozen.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from figures import report
from serving_stack import Stack, start_stack
from stream_load import comparable, stream_text
from transformers import AutoTokenizer

from cleave.common import metric_names as names
from cleave.runtime.serving.router import Router, RouterConfig

# The healthy worker's streams must never pause this long, even with 8 of them on a loaded
# 2-core box: the router would drop that worker too.
IDLE_TIMEOUT = 4.0
STREAMS = 8
MAX_TOKENS = 300  # long enough that every stream is still running when the worker freezes
# After the freeze: the idle timeout, then the rest of the stream on the other worker (a
# loaded 2-core box generates the 8 streams' remaining tokens in about a second; the rest is
# slack for the box).
FINISH_WITHIN = IDLE_TIMEOUT + 12.0
PROMPTS = [f"the robot counts {i} apples near the station and the teacher reads" for i in
           range(STREAMS)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for both tests (a worker's start-up is most of their time): Redis, one
    prefill worker, two decode workers and the router."""
    stack = start_stack(tiny_model_dir, tmp_path_factory.mktemp("freeze"), prefill=1, decode=2)
    try:
        yield stack
    finally:
        for proc in [stack.redis.proc, *(w.proc for w in stack.workers)]:
            if proc.poll() is None:  # a stopped process cannot act on SIGTERM
                os.kill(proc.pid, signal.SIGCONT)
        stack.stop()


def _decoders(stack: Stack) -> list[Any]:
    return [w for w in stack.workers if w.name.startswith("decode")]


def _running(url: str) -> int:
    with urllib.request.urlopen(url + "/internal/stats", timeout=5) as r:
        return int(json.loads(r.read())["running"])


async def _stream(client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event,
                  frozen_at: list[float]) -> tuple[list[Any], float]:
    chunks = []
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 2:
            started.set()
    return chunks, time.monotonic() - frozen_at[0] if frozen_at else -1.0


async def test_a_frozen_decode_worker_is_left_within_the_idle_timeout(
        stack: Stack, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="cleave.router")
    urls = tuple(w.url for w in _decoders(stack))
    config = RouterConfig(model="tiny", decode_urls=urls,
                          worker_idle_timeout_seconds=IDLE_TIMEOUT)
    router = Router(config, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 512, 512)
    server = TestClient(TestServer(router.app()))
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="-",
                                max_retries=0, timeout=60)
    try:
        wants = [a.choices[0].text for a in await asyncio.gather(*(client.completions.create(
            model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}) for p in PROMPTS))]
        frozen_at: list[float] = []
        events = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(_stream(client, p, e, frozen_at))
                 for p, e in zip(PROMPTS, events, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        # The worker running the most of them (the router may have put all on one).
        busiest = max(_decoders(stack), key=lambda w: _running(w.url))
        assert _running(busiest.url) > 0
        os.kill(busiest.proc.pid, signal.SIGSTOP)
        frozen_at.append(time.monotonic())
        try:
            done = await asyncio.wait_for(asyncio.gather(*tasks), FINISH_WITHIN + 30)
        except TimeoutError:
            pytest.fail(f"streams hung on the frozen worker past {FINISH_WITHIN + 30:.0f} s")
        after = await client.completions.create(model="tiny", prompt="still serving",
                                                max_tokens=4, timeout=FINISH_WITHIN)
    finally:
        if frozen_at:
            os.kill(busiest.proc.pid, signal.SIGCONT)
        await client.close()
        await server.close()
    resumed = [r.getMessage() for r in caplog.records if "resuming it on another" in r.getMessage()]
    report("freeze", streams=STREAMS, resumed=len(resumed),
           finished_after_freeze_s=sorted(round(t, 1) for _, t in done))
    assert resumed, "no stream was on the frozen worker: the test proved nothing"
    for (chunks, took), want in zip(done, wants, strict=True):
        assert took < FINISH_WITHIN, f"a stream ended {took:.1f} s after the freeze"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert comparable(stream_text(chunks, chat=False)) == comparable(want)
    assert after.choices[0].finish_reason in ("stop", "length")


REDIS_FROZEN_REQUESTS = 4
# A frozen Redis answers nothing: each store call waits out the workers' store timeout (0.5 s
# in serving_stack) and the request recomputes. A few of those, and the request's own time.
FROZEN_STORE_BOUND = 8.0


def _total(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def test_a_frozen_redis_costs_store_timeouts_not_requests(stack: Stack) -> None:
    """Redis frozen (SIGSTOP) while disaggregated requests are served: the prefill worker's
    save and the decode worker's load time out, the decode worker recomputes, and each
    request is answered within a few store timeouts, with the text it has with Redis back."""
    assert stack.router is not None
    client = openai.OpenAI(base_url=stack.router.url + "/v1", api_key="-",
                           max_retries=0, timeout=2 * FROZEN_STORE_BOUND)  # a hang fails fast
    fallbacks = names.total(names.KV_RECOMPUTE_FALLBACKS)

    def recomputed() -> float:
        return sum(_total(w.url, fallbacks) for w in _decoders(stack))

    before = recomputed()
    # > 16 tokens: disaggregated, so the blocks go through the store; new to every worker.
    prompts = [f"request {i}: " + "the engineer builds many books before dinner " * 4
               for i in range(REDIS_FROZEN_REQUESTS)]
    os.kill(stack.redis.proc.pid, signal.SIGSTOP)
    took, got = [], []
    try:
        for prompt in prompts:
            began = time.monotonic()
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})
            took.append(time.monotonic() - began)
            got.append(answer.choices[0].text)
        fell_back = recomputed() - before
    finally:
        os.kill(stack.redis.proc.pid, signal.SIGCONT)
    wants = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    report("freeze_redis", requests=len(prompts), took_s=[round(t, 2) for t in took],
           recomputed=fell_back)
    assert max(took) < FROZEN_STORE_BOUND, took
    assert fell_back >= 1, "no request went through the frozen store: it proved nothing"
    assert [comparable(t) for t in got] == [comparable(t) for t in wants]
