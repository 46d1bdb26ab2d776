"""`cleave bench`'s client, runner and command against a small real aiohttp server.

The stub server runs on its own event loop in a thread, so that both the async client tests and
the in-process ``cleave bench`` runs (which start their own loop) can talk to it. Each path
prefix is one behaviour: ``/ok/v1/...`` streams with known delays, ``/e500/v1/...`` fails, etc.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cleave.runtime.cli import main
from cleave.runtime.loadgen import record as rec
from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop, arrival_offsets
from cleave.runtime.loadgen.client import ClientConfig, api_root, list_models, send
from cleave.runtime.loadgen.progress import Progress
from cleave.runtime.loadgen.runner import Limits, run
from cleave.runtime.loadgen.workload import LengthDist, RequestSpec, Workload

FIRST_DELAY, GAP, CHUNKS = 0.3, 0.1, 4  # the /ok stream: first text after 0.3 s, then every 0.1 s


class Stub:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""


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
        await resp.write(_data({"choices": [], "usage": {"prompt_tokens": 7,
                                                         "completion_tokens": CHUNKS}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def busy(request: web.Request) -> web.StreamResponse:
        stub.in_flight += 1
        stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        try:
            await asyncio.sleep(0.05)
            resp = await _sse(request)
            await resp.write(_data({"choices": [{"text": "x"}]}))
            await resp.write(_data({"choices": [], "usage": {"prompt_tokens": 3,
                                                             "completion_tokens": 1}}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            stub.in_flight -= 1

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

    app = web.Application()
    for prefix, handler in (("ok", ok), ("busy", busy), ("e500", e500), ("bad", bad),
                            ("nodone", nodone), ("inband", inband), ("json", plain_json),
                            ("hang", hang)):
        app.router.add_post(f"/{prefix}/v1/completions", handler)
        app.router.add_post(f"/{prefix}/v1/chat/completions", handler)
        app.router.add_get(f"/{prefix}/v1/models", models)
    return app


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
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
    yield s
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _cfg(stub: Stub, prefix: str, chat: bool = False, timeout: float = 20.0) -> ClientConfig:
    return ClientConfig(api_root(f"{stub.url}/{prefix}"), "stub-model", chat, timeout)


SPEC = RequestSpec(index=3, max_tokens=CHUNKS, prompt="hello there")


@pytest.mark.parametrize("chat", [False, True])
async def test_stream_timing_and_usage(stub: Stub, chat: bool) -> None:
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        r = await send(session, _cfg(stub, "ok", chat), SPEC, t0)
    assert r.ok, r.error_detail
    assert r.index == 3 and 0 <= r.start < 0.5
    assert r.ttft is not None and FIRST_DELAY - 0.01 <= r.ttft < FIRST_DELAY + 0.5
    assert len(r.chunk_times) == CHUNKS and len(r.itls) == CHUNKS - 1
    assert all(GAP - 0.01 <= x < GAP + 0.3 for x in r.itls)
    assert (r.prompt_tokens, r.output_tokens, r.usage_reported) == (7, CHUNKS, True)
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / (CHUNKS - 1))
    assert r.e2e >= r.chunk_times[-1]
    body = stub.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "stub-model" and body["max_tokens"] == CHUNKS
    assert body["ignore_eos"] is True and "temperature" not in body
    if chat:
        assert body["messages"] == [{"role": "user", "content": "hello there"}]
    else:
        assert body["prompt"] == "hello there"


@pytest.mark.parametrize(("prefix", "error", "detail"), [
    ("e500", "http_500", "engine exploded"),
    ("bad", rec.MALFORMED, "not JSON"),
    ("nodone", rec.MALFORMED, "without `data: [DONE]`"),
    ("json", rec.MALFORMED, "expected text/event-stream"),
    ("inband", rec.STREAM_ERROR, "mid-response"),
])
async def test_failures_are_classified(stub: Stub, prefix: str, error: str, detail: str) -> None:
    async with aiohttp.ClientSession() as session:
        r = await send(session, _cfg(stub, prefix), SPEC, time.perf_counter())
    assert not r.ok and r.error == error
    assert detail in r.error_detail


async def test_a_hung_server_times_out(stub: Stub) -> None:
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        r = await send(session, _cfg(stub, "hang", timeout=0.5), SPEC, start)
    assert r.error == rec.TIMEOUT and "0.5 s" in r.error_detail
    assert 0.45 <= time.perf_counter() - start < 5


async def test_a_refused_connection() -> None:
    from redis_servers import free_port

    cfg = ClientConfig(api_root(f"http://127.0.0.1:{free_port()}"), "m", False, 10.0)
    async with aiohttp.ClientSession() as session:
        r = await send(session, cfg, SPEC, time.perf_counter())
    assert r.error == rec.CONNECTION and "Connect" in r.error_detail


async def test_model_list(stub: Stub) -> None:
    async with aiohttp.ClientSession() as session:
        assert await list_models(session, api_root(stub.url + "/ok/v1/"), None) == [
            "stub-model", "b"]


def _quiet() -> Progress:
    return Progress(None, None, stream=io.StringIO(), tty=False)


WORKLOAD = Workload(output_len=LengthDist(1, 1), prompt_len=LengthDist(3, 3))


async def test_closed_loop_keeps_the_concurrency(stub: Stub) -> None:
    stub.max_in_flight = 0
    async with aiohttp.ClientSession() as session:
        res = await run(session, _cfg(stub, "busy"), WORKLOAD, ClosedLoop(3), Limits(12), 0,
                        _quiet())
    assert sorted(r.index for r in res.records) == list(range(12))
    assert all(r.ok for r in res.records) and not res.interrupted
    assert stub.max_in_flight == 3


async def test_open_loop_follows_the_arrival_times(stub: Stub) -> None:
    schedule = OpenLoop(rate=40.0)
    async with aiohttp.ClientSession() as session:
        res = await run(session, _cfg(stub, "busy"), WORKLOAD, schedule, Limits(16), seed=4,
                        progress=_quiet())
    planned = [t for t, _ in zip(arrival_offsets(schedule, 4), range(16), strict=False)]
    starts = {r.index: r.start for r in res.records}
    assert sorted(starts) == list(range(16))
    assert all(starts[i] >= planned[i] - 0.005 for i in range(16))  # never early
    assert starts[15] < planned[15] + 1.0  # and not far behind, even on a loaded box
    assert res.duration >= max(r.start + r.e2e for r in res.records) - 1e-9


async def test_duration_limit_and_stop(stub: Stub) -> None:
    async with aiohttp.ClientSession() as session:
        res = await run(session, _cfg(stub, "busy"), WORKLOAD, ClosedLoop(2),
                        Limits(duration=0.4), 0, _quiet())
        assert res.records and max(r.start for r in res.records) < 0.4 + 0.05
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        began = time.perf_counter()
        res = await run(session, _cfg(stub, "hang"), WORKLOAD, ClosedLoop(2), Limits(5), 0,
                        _quiet(), stop)
    assert time.perf_counter() - began < 5 and res.interrupted
    assert [r.error for r in res.records] == [rec.CANCELLED, rec.CANCELLED]


def _bench(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["bench", "--out", str(tmp_path), "--num-requests", "3", *args])
    path = tmp_path / "report.json"
    return code, json.loads(path.read_text()) if path.exists() else {}


def test_command_exit_status_and_report(stub: Stub, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _bench(tmp_path / "ok", "--url", stub.url + "/ok", "--concurrency", "2",
                          "--no-plots", "--ttft-slo", "5000")
    assert code == 0
    assert report["config"]["model"] == "stub-model"  # the first of /v1/models
    assert report["requests"]["completed"] == 3 and report["tokens"]["output"] == 3 * CHUNKS
    assert report["goodput"]["good_requests"] == 3
    out = capsys.readouterr().out
    assert "Latency (ms)" in out and f"report: {tmp_path / 'ok' / 'report.json'}" in out
    code, report = _bench(tmp_path / "fail", "--url", stub.url + "/e500", "--rate", "50")
    assert code == 1
    assert report["errors"]["http_500"]["count"] == 3
    assert sorted(p.name for p in (tmp_path / "fail").glob("*.png")) == [
        "latency_cdf.png", "latency_over_time.png", "throughput_over_time.png"]


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-len", "uniform:9-3"], "low <= high"),
    (["--rate", "2", "--burstiness", "0.5"], "--burstiness needs --arrivals bursty"),
    (["--arrivals", "bursty"], "do not apply to --concurrency"),
    (["--ttft-slo", "0"], "--ttft-slo must be positive"),
    (["--prompts", "/nonexistent.jsonl"], "cannot read /nonexistent.jsonl"),
    (["--url", "localhost:8000"], "bad --url"),
])
def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            args: list[str], message: str) -> None:
    assert main(["bench", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_unreachable_server_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from redis_servers import free_port

    assert main(["bench", "--url", f"http://127.0.0.1:{free_port()}", "--out",
                 str(tmp_path)]) == 2
    assert "cannot reach" in capsys.readouterr().err
