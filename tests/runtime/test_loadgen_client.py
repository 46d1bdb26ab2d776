"""`cleave bench`'s client, runner and command against a small real aiohttp server
(tests/runtime/loadgen_stub.py: each path prefix is one behaviour)."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from loadgen_stub import (
    CHUNKS,
    FIRST_DELAY,
    GAP,
    PROMPT_TOKENS,
    SLOW_S,
    Stub,
    running_stub,
    stub_tokens,
)

from cleave.common.cli import main
from cleave.runtime.loadgen import record as rec
from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop, arrival_offsets
from cleave.runtime.loadgen.client import ClientConfig, api_root, list_models, send
from cleave.runtime.loadgen.progress import Progress
from cleave.runtime.loadgen.runner import Limits, run
from cleave.runtime.loadgen.workload import LengthDist, RequestSpec, Workload


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    with running_stub() as s:
        yield s


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
    # Each gap as the stub spaced it; one alone looks short when the client read the chunk
    # before it late (a busy box), so the lower bounds allow for one such late read.
    assert all(GAP / 2 <= x < GAP + 0.3 for x in r.itls), r.itls
    assert sum(r.itls) >= (CHUNKS - 1) * GAP - GAP / 2, r.itls
    assert (r.prompt_tokens, r.output_tokens, r.usage_reported) == (PROMPT_TOKENS, CHUNKS, True)
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


def _last_json_line(out: str) -> dict[str, Any]:
    line: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return line


def test_command_exit_status_and_report(stub: Stub, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _bench(tmp_path / "ok", "--url", stub.url + "/ok", "--concurrency", "2",
                          "--no-plots", "--ttft-slo", "5")
    assert code == 0
    assert report["config"]["model"] == "stub-model"  # the first of /v1/models
    assert report["requests"]["completed"] == 3 and report["tokens"]["output"] == 3 * CHUNKS
    assert report["goodput"]["good_requests"] == 3
    # Synthetic prompts of the default 128 tokens, counted with the server's /tokenize.
    assert [stub_tokens(b["prompt"]) for b in stub.bodies[-3:]] == [128, 128, 128]
    # The KV-store figures from the worker the stub's /internal/workers lists: 6 blocks read
    # during the run, 3 of them handoffs: 3 prefix blocks of 16 tokens over 3 x 64 prompt tokens.
    assert report["server"]["kv_store_prefix_blocks"] == 3
    assert report["server"]["routing"] == {"disaggregated": 3}  # the router's own /metrics
    assert report["server"]["kv_store_hit_rate"] == pytest.approx(3 * 16 / (3 * PROMPT_TOKENS))
    out = capsys.readouterr().out
    assert "Latency (ms)" in out and f"report: {tmp_path / 'ok' / 'report.json'}" in out
    assert "KV store      hit rate 25.0% of prompt tokens" in out
    line = _last_json_line(out)  # the one JSON line, last: vllm bench serve's names
    assert line["completed"] == 3 and line["failed"] == 0 and line["num_prompts"] == 3
    assert line["request_goodput"] == report["request_goodput"] > 0
    assert line["mean_ttft_ms"] == report["latency_ms"]["ttft"]["mean"] >= FIRST_DELAY * 1000
    assert line["server"] == report["server"] and line["report"].endswith("report.json")
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms",
                "p99_e2el_ms", "duration", "total_input_tokens", "total_output_tokens"):
        assert line[key] == report[key], key  # also at report.json's top level
    code, report = _bench(tmp_path / "fail", "--url", stub.url + "/e500", "--rate", "50")
    assert code == 1
    assert report["errors"]["http_500"]["count"] == 3
    assert report["server"] is None  # this stub path lists no workers
    assert sorted(p.name for p in (tmp_path / "fail").glob("*.png")) == [
        "latency_cdf.png", "latency_over_time.png", "throughput_over_time.png"]


def test_prompt_lengths_are_in_the_servers_tokens(stub: Stub, tmp_path: Path) -> None:
    stub.bodies.clear()
    code, report = _bench(tmp_path, "--url", stub.url + "/busy", "--num-requests", "12",
                          "--prompt-len", "uniform:5-40", "--concurrency", "3", "--no-plots")
    assert code == 0 and len(stub.bodies) == 12
    lengths = [stub_tokens(b["prompt"]) for b in stub.bodies]
    assert all(5 <= n <= 40 for n in lengths) and len(set(lengths)) > 3
    # Only one-token words were used, so each prompt has as many tokens as words.
    assert lengths == [len(b["prompt"].split()) for b in stub.bodies]
    assert report["config"]["workload"] == ("synthetic prompts of uniform:5-40 tokens, "
                                            "output fixed:64 tokens")


def test_warm_up_is_left_out_of_every_figure(stub: Stub, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stub.bodies.clear()
    stub.slow_first = 2  # the first two requests the server sees take a second
    code, report = _bench(tmp_path, "--url", stub.url + "/slowstart", "--num-warmups", "2",
                          "--no-plots")
    assert code == 0
    assert len(stub.bodies) == 5  # 2 warm-up + 3 measured requests reached the server
    assert report["warmup"] == {"sent": 2, "completed": 2, "failed": 0}
    assert report["requests"]["sent"] == 3 and report["num_prompts"] == 3
    assert [r["index"] for r in report["per_request"]] == [0, 1, 2]
    assert report["latency_ms"]["e2e"]["max"] < 900  # the slow warm-ups are not in it
    assert report["duration_s"] < 1.5  # and the clock started after them
    err = capsys.readouterr().err
    assert "warm-up: 2 requests, 2 ok, 0 failed" in err


def test_rate_under_a_concurrency_cap(stub: Stub, tmp_path: Path) -> None:
    stub.max_in_flight = 0
    code, report = _bench(tmp_path, "--url", stub.url + "/slow", "--rate", "50",
                          "--max-concurrency", "2", "--num-requests", "8", "--no-plots")
    assert code == 0 and report["requests"]["completed"] == 8
    # 50 req/s of 0.3 s requests would keep about 15 in flight; the cap holds it to 2.
    assert stub.max_in_flight == 2 and report["max_concurrent_requests"] == 2
    assert report["duration_s"] >= 4 * SLOW_S  # 8 requests, 2 at a time
    assert (report["request_rate"], report["max_concurrency"]) == (50.0, 2)


async def test_open_loop_cap_keeps_the_arrival_times(stub: Stub) -> None:
    schedule = OpenLoop(rate=40.0, max_concurrency=3)
    stub.max_in_flight = 0
    async with aiohttp.ClientSession() as session:
        res = await run(session, _cfg(stub, "slow"), WORKLOAD, schedule, Limits(9), seed=2,
                        progress=_quiet())
    planned = list(itertools.islice(arrival_offsets(schedule, 2), 9))
    starts = {r.index: r.start for r in res.records}
    assert sorted(starts) == list(range(9)) and stub.max_in_flight == 3
    assert all(starts[i] >= planned[i] - 0.005 for i in range(9))  # never before its arrival
    assert starts[8] >= 2 * SLOW_S  # the last three waited for two rounds to finish


def test_a_server_without_tokenize_is_refused_clearly(
        stub: Stub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", stub.url + "/json", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "/tokenize answered 404" in err and "--prompts FILE" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-len", "uniform:9-3"], "low <= high"),
    (["--rate", "2", "--burstiness", "0.5"], "--burstiness needs --arrivals bursty"),
    (["--arrivals", "bursty"], "do not apply to --concurrency"),
    (["--ttft-slo", "0"], "--ttft-slo must be positive"),
    (["--ttft-slo", "fast"], "--ttft-slo takes seconds"),
    (["--shared-prefix", "2", "--prompt-len", "9"], "give the suffix with --suffix-len"),
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
