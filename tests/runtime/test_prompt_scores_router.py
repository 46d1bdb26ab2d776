"""Prompt scores (``prompt_logprobs``, an echo's logprobs) through the router, against a stub
worker that writes real wire lines: a long prompt's scores come back whole (its one line is far
over the reader's usual bound), a response that would carry too many is a 400, and a failure
nobody expected is still OpenAI's error shape (a JSON 500, or an in-band event then ``[DONE]``).
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from stub_worker_support import stub_worker_app
from transformers import AutoTokenizer

from cleave.runtime.serving import responses
from cleave.runtime.serving.logprobs import PromptScores
from cleave.runtime.serving.router import Router, RouterConfig
from cleave.runtime.serving.wire import GenerateRequest, LineLogprob, TokenLine

Client = TestClient[web.Request, web.Application]
CONTEXT = 8192


def _scores(prompt: list[int], top: int) -> list[LineLogprob]:
    """What an engine sends: prompt tokens 1.., each with ``top`` alternatives; logprobs with
    all their digits, as real ones have."""
    rng = random.Random(len(prompt))
    return [LineLogprob(token_id=t, logprob=-rng.random() * 20, rank=rng.randrange(1, 500),
                        top=[(rng.randrange(500), -rng.random() * 20) for _ in range(top)])
            for t in prompt[1:]]


def stub_worker(text: str) -> web.Application:
    """Answers each request with two lines, as a worker would: the first token (``text``,
    with the prompt's scores when asked), then the last."""
    async def generate(request: web.Request) -> web.StreamResponse:
        asked = GenerateRequest.model_validate_json(await request.read())
        ids, top = asked.prompt_token_ids, asked.sampling.prompt_logprobs
        counts = {"prompt_tokens": len(ids), "cached_tokens": 0}
        first = TokenLine(token_ids=[5], text=text, completion_tokens=1, **counts,
                          prompt_logprobs=None if top is None else _scores(ids, top))
        last = TokenLine(token_ids=[6], text="b", finished=True, finish_reason="length",
                         completion_tokens=2, **counts)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for line in (first, last):
            await response.write(line.model_dump_json(exclude_none=True).encode() + b"\n")
        await response.write_eof()
        return response

    return stub_worker_app(generate)


@pytest.fixture
async def router(tiny_model_dir: Path) -> AsyncIterator[Callable[..., Awaitable[Client]]]:
    opened: list[Any] = []

    async def make(text: str = "a", **config: Any) -> Client:
        worker = TestServer(stub_worker(text))
        await worker.start_server()
        opened.append(worker)
        url = str(worker.make_url("")).rstrip("/")
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        routed = Router(RouterConfig(model="tiny", decode_urls=(url,), **config), tokenizer,
                        CONTEXT, len(tokenizer))
        client: Client = TestClient(TestServer(routed.app()))
        await client.start_server()
        opened.append(client)
        return client

    yield make
    for each in reversed(opened):
        await each.close()


def _prompt(tokens: int) -> list[int]:
    rng = random.Random(tokens)
    return [rng.randrange(3, 500) for _ in range(tokens)]


async def test_a_long_prompt_s_scores_at_top_20_come_back_whole(router: Any) -> None:
    """Before: the worker's line (about 1.6 MB here) overran the router's 512 KiB line bound,
    and the client got a text/plain 500."""
    client = await router()
    prompt = _prompt(3000)
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 20})
    assert response.status == 200, await response.text()
    [choice] = (await response.json())["choices"]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    assert all(str(t) in entry for t, entry in zip(prompt[1:], scores[1:], strict=True))
    assert max(len(entry) for entry in scores[1:]) == 21  # its own, and the top 20 (distinct)


async def test_a_line_over_what_the_request_allows_is_a_502_not_a_worker_down(
        router: Any) -> None:
    """Asking no scores, a line is held to the reader's usual bound (512 KiB): one over it is
    a broken worker's reply, answered as such, and the worker stays in rotation (a line bound
    crossed is no sign that it is down)."""
    client = await router(text="x" * (600 << 10))
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert response.status == 502 and response.content_type == "application/json"
    error = (await response.json())["error"]
    assert error["type"] == "server_error" and error["code"] == "worker_failed"
    [worker] = (await (await client.get("/internal/workers")).json())["decode"]
    assert worker["healthy"], worker


async def test_more_scores_than_the_limit_is_a_400_naming_the_field(router: Any) -> None:
    client = await router(max_prompt_scores=1200)
    prompt = _prompt(100)
    asked = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    # 100 tokens x (5 + 1) x 2 choices = 1,200: at the limit.
    ok = await client.post("/v1/completions", json={**asked, "prompt_logprobs": 5, "n": 2})
    assert ok.status == 200, await ok.text()
    for extra, param in (({"prompt_logprobs": 5, "n": 3}, "prompt_logprobs"),
                         ({"prompt_logprobs": 12}, "prompt_logprobs"),
                         ({"echo": True, "logprobs": 5, "n": 3}, "logprobs")):
        refused = await client.post("/v1/completions", json={**asked, **extra})
        assert refused.status == 400, extra
        error = (await refused.json())["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "1200" in error["message"], error
    chat = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi " * 300}],
        "max_tokens": 2, "prompt_logprobs": 20})
    assert chat.status == 400 and (await chat.json())["error"]["param"] == "prompt_logprobs"
    # Chat carries the field once on the body, whatever n: 4 choices cost what one does.
    chat = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi " * 80}],
        "max_tokens": 2, "prompt_logprobs": 5, "n": 4})
    assert chat.status == 200, await chat.text()
    body = await chat.json()
    assert len(body["choices"]) == 4 and 4 * 6 * len(body["prompt_logprobs"]) > 1200


def _boom(*_: Any, **__: Any) -> Any:
    raise RuntimeError("a bug")


async def test_an_unexpected_failure_is_a_json_500(
        router: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    client = await router()
    monkeypatch.setattr(responses, "final_response", _boom)
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert response.status == 500 and response.content_type == "application/json"
    error = (await response.json())["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    assert response.headers["X-Request-Id"]
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


async def test_an_unexpected_failure_mid_stream_is_an_error_event_then_done(
        router: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    client = await router()
    chunks = responses.StreamWriter.chunks
    calls = []

    def second_fails(self: responses.StreamWriter, line: TokenLine, index: int = 0
                     ) -> list[bytes]:
        calls.append(line)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return chunks(self, line, index)

    monkeypatch.setattr(responses.StreamWriter, "chunks", second_fails)
    response = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True})
    assert response.status == 200
    events = [e for e in (await response.text()).split("\n\n") if e]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "a"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error"
    assert events[2:] == ["data: [DONE]"]
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


def test_n_choices_cost_about_what_one_does_to_build(tiny_model_dir: Path) -> None:
    """Every choice shows the prompt's scores: they are built and validated once, not once a
    choice (before, n=8 cost about 4 times n=1). CPU seconds of this process, not wall time,
    which another process's burst would skew; a generous bound, as the body is still n times
    the size."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = _prompt(2000)
    first = TokenLine(token_ids=[5], text="a", prompt_logprobs=_scores(prompt, 20))
    last = TokenLine(token_ids=[6], text="b", finished=True, finish_reason="length",
                     prompt_tokens=len(prompt), completion_tokens=2, cached_tokens=0)

    def cpu_seconds(n: int) -> float:
        scores = PromptScores(prompt[0], 20, None)
        scores.take(first)
        gc.collect()  # other tests' garbage: collected now, not counted against this build
        start = time.process_time()
        body = responses.final_response("cmpl-1", "tiny", False, [[first, last]] * n,
                                        lambda t: str(tokenizer.decode([t])), False,
                                        prompt=scores)
        spent = time.process_time() - start
        assert len(body.choices) == n
        assert all(len(c.prompt_logprobs or ()) == len(prompt) for c in body.choices)
        return spent

    cpu_seconds(1)  # warm: the first build pays for imports and caches
    one, eight = (min(cpu_seconds(n) for _ in range(3)) for n in (1, 8))  # the least noise
    assert eight < 2.0 * one, (one, eight)


def test_a_negative_limit_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="max_prompt_scores"):
        RouterConfig(model="tiny", decode_urls=("http://127.0.0.1:9",), max_prompt_scores=-1)
