"""Workers are convertible: every one holds the whole model, so a role is where work prefers to
go, not a wall. Real worker processes, redis-server and router; the official `openai` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from serving_stack import Stack, start_stack

from cleave.common import metric_names as names
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams

LONG = "the quick brown fox jumps over the lazy dog " * 8  # > 16 tokens: disaggregated


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                  kv_cache_bytes=1 << 23), progress=lambda _: None)


@pytest.fixture
def own_stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path)
    yield s
    s.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


def _decisions(stack: Stack) -> dict[tuple[str, str], float]:
    """``cleave_routing_decisions_total`` by (path, reason), from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    assert stack.router is not None
    text = urllib.request.urlopen(stack.router.url + "/metrics").read().decode()
    return {(s.labels["path"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == names.total(names.ROUTING_DECISIONS)}


def _generated(url: str) -> float:
    """The worker's ``cleave_generation_tokens_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == names.total(names.GENERATION_TOKENS))


def test_the_only_decode_worker_dying_mid_stream_costs_no_request(own_stack: Stack,
                                                                  reference: LLMEngine) -> None:
    """The default split (one prefill, one decode worker) loses its decode worker under a
    stream: the prefill worker finishes that stream and serves the requests that follow."""
    decode = next(w for w in own_stack.workers if w.name.startswith("decode"))
    client = _client(own_stack)
    [want] = reference.generate([LONG], SamplingParams(max_tokens=200, ignore_eos=True))
    stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=200,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = []
    started = time.monotonic()
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            decode.kill()
    assert time.monotonic() - started < 30, "never a hang"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text  # resumed where it broke: nothing lost, nothing repeated
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 200
    # New requests, long and short, are served whole by the prefill worker.
    for prompt in (LONG, "hello there"):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                        temperature=0)
        [ref] = reference.generate([prompt], SamplingParams(max_tokens=8))
        assert got.choices[0].text == ref.text
    assert _decisions(own_stack)[("prefill_only", "no_decode_worker")] == 2
    # The resumed stream's tokens and the two requests' were made on the prefill worker.
    prefill = next(w for w in own_stack.workers if w.name.startswith("prefill"))
    assert _generated(prefill.url) >= 200 - 3 + 2 * 8


def test_a_prefill_backlog_past_the_ttft_target_is_served_by_decode_workers(
        tiny_model_dir: Path, tmp_path: Path, reference: LLMEngine) -> None:
    """With a TTFT target no prefill can meet: long prompts still go to the idle prefill
    worker (no queue to skip: a decode worker would take as long); once one is stuck there
    (the worker frozen), the next is served whole by the decode worker, and is still right."""
    stack = start_stack(tiny_model_dir, tmp_path, router_args=("--ttft-target", "1e-9"))
    try:
        client = _client(stack)
        # Distinct first words: no prompt finds another's blocks cached (that path skips the
        # prefill for its own reason).
        prompts = [f"{word} {LONG}" for word in ("one", "two", "three", "four")]
        wants = [w.text for w in reference.generate(prompts, SamplingParams(max_tokens=6))]

        def ask(prompt: str) -> str:
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            temperature=0)
            return str(got.choices[0].text)

        assert [ask(p) for p in prompts[:2]] == wants[:2]  # the second with a speed measured
        assert _decisions(stack)[("disaggregated", "long_prompt")] == 2
        prefill = next(w for w in stack.workers if w.name.startswith("prefill"))
        prefill.proc.send_signal(signal.SIGSTOP)  # a prefill in flight: a queue to skip
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                stuck = pool.submit(ask, prompts[2])
                _until(lambda: _queued_at(stack, prefill.url) > 0, 30)
                assert ask(prompts[3]) == wants[3]  # served while the prefill worker is frozen
                assert not stuck.done()
                prefill.proc.send_signal(signal.SIGCONT)
                assert stuck.result(timeout=60) == wants[2]
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        decisions = _decisions(stack)
        assert decisions[("disaggregated", "long_prompt")] == 3
        assert decisions[("decode_only", "prefill_backlog")] == 1
    finally:
        stack.stop()


def _post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _router_roles(stack: Stack) -> dict[str, str | None]:
    assert stack.router is not None
    seen = json.loads(urllib.request.urlopen(stack.router.url + "/internal/workers").read())
    return {w["url"]: w["role"] for pool in ("prefill", "decode") for w in seen[pool]}


def _queued_at(stack: Stack, url: str) -> int:
    """The prompt tokens the router has sent ``url`` that are not done yet."""
    assert stack.router is not None
    seen = json.loads(urllib.request.urlopen(stack.router.url + "/internal/workers").read())
    return int(next(w["queued_tokens"] for pool in ("prefill", "decode") for w in seen[pool]
                    if w["url"] == url))


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_live_flip_moves_a_warm_worker_between_roles(tiny_model_dir: Path, tmp_path: Path,
                                                      reference: LLMEngine) -> None:
    """Two decode workers and no prefill worker: flipping one to prefill (no restart) makes the
    router disaggregate through it within its poll; flipping it back ends that."""
    stack = start_stack(tiny_model_dir, tmp_path, prefill=0, decode=2)
    try:
        client = _client(stack)
        flipped = stack.workers[1]
        pid = flipped.proc.pid
        status, body = _post(flipped.url + "/internal/role", b'{"role": "prefill"}')
        assert status == 200 and body == {"role": "prefill", "previous": "decode",
                                          "home_role": "decode"}
        _until(lambda: _router_roles(stack)[flipped.url] == "prefill")
        prompts = [f"{word} {LONG}" for word in ("red", "green", "blue")]
        wants = reference.generate(prompts, SamplingParams(max_tokens=6))
        for prompt, want in zip(prompts, wants, strict=True):
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            temperature=0)
            assert got.choices[0].text == want.text
        assert _decisions(stack)[("disaggregated", "long_prompt")] == 3
        assert flipped.proc.pid == pid and flipped.proc.poll() is None  # no restart
        metrics = urllib.request.urlopen(flipped.url + "/metrics").read().decode()
        assert f'{names.RUNNING}{{role="prefill"}}' in metrics
        assert f'{names.RUNNING}{{role="decode"}}' not in metrics  # counted once
        # Back home: the router stops sending it prefills.
        assert _post(flipped.url + "/internal/role", b'{"role": "decode"}')[0] == 200
        _until(lambda: _router_roles(stack)[flipped.url] == "decode")
        client.completions.create(model="tiny", prompt=f"yellow {LONG}", max_tokens=2)
        assert _decisions(stack)[("decode_only", "no_prefill_workers")] == 1
    finally:
        stack.stop()


@pytest.mark.parametrize("body, status", [
    (b"not json", 400), (b'{"role": "both"}', 400), (b'{"role": "router"}', 400),
    (b"[]", 400)])
def test_a_bad_flip_is_refused_and_changes_nothing(body: bytes, status: int,
                                                   tiny_model_dir: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from cleave.runtime.engine.async_engine import AsyncEngine
    from cleave.runtime.serving.worker import Worker

    async def run() -> None:
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                                    kv_cache_bytes=1 << 22),
                                       progress=lambda _: None))
        worker = Worker(engine, "decode", None)
        async with TestClient(TestServer(worker.app())) as client:
            response = await client.post("/internal/role", data=body)
            assert response.status == status
            assert "role" in (await response.json())["error"]["message"]
            stats = await (await client.get("/internal/stats")).json()
            assert (stats["role"], stats["home_role"], stats["flips"]) == ("decode", "decode", 0)
        engine.shutdown()

    asyncio.run(run())
