"""`cleave bench` as a user runs it: a subprocess against a real stack (redis-server, a prefill
and a decode worker, the router) on the tiny model."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serving_stack import CLI, Stack, start_stack

from cleave.runtime.loadgen import tokens
from cleave.runtime.loadgen.workload import WORDS, LengthDist, SharedPrefix, Workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("bench-stack-logs"))
    yield s
    s.stop()


def _bench(stack: Stack, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str],
                                                          dict[str, Any]]:
    assert stack.router is not None
    proc = subprocess.run([*CLI, "bench", "--url", stack.router.url, "--out", str(out),
                           "--timeout", "60", *args],
                          capture_output=True, text=True, timeout=180)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else {}
    return proc, report


def _tokenize(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.router is not None
    req = urllib.request.Request(stack.router.url + "/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _special_tokens(stack: Stack) -> int:
    """Tokens the server adds to a completion's text prompt."""
    def count(special: bool) -> int:
        n: int = _tokenize(stack, {"prompt": "the", "add_special_tokens": special})["count"]
        return n
    return count(True) - count(False)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_bench_against_a_real_stack(stack: Stack, tmp_path: Path) -> None:
    proc, report = _bench(stack, tmp_path, "--concurrency", "4", "--num-requests", "20",
                          "--prompt-len", "uniform:8-40", "--output-len", "uniform:4-12",
                          "--ttft-slo", "60", "--tpot-slo", "60")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert report["config"]["model"] == "tiny"  # asked of GET /v1/models
    assert report["requests"] == {"sent": 20, "completed": 20, "failed": 0, "cancelled": 0,
                                  "without_usage": 0}
    assert report["errors"] == {}
    # Token counts are the server's usage: with ignore_eos every output runs to max_tokens.
    per = report["per_request"]
    assert all(4 <= r["output_tokens"] <= 12 for r in per)
    assert report["tokens"]["output"] == sum(r["output_tokens"] for r in per) > 0
    # Prompt lengths are in the model's tokens: the server's usage says the same, plus the
    # special tokens it adds to a completion's prompt (the BOS, as vLLM does).
    extra = _special_tokens(stack)
    asked = [r["prompt_tokens"] - extra for r in per]
    assert all(8 <= n <= 40 for n in asked) and len(set(asked)) > 5
    assert report["throughput"]["output_tokens_per_s"] > 0
    for key in ("ttft", "tpot", "itl", "e2e"):
        dist = report["latency_ms"][key]
        assert 0 < dist["p50"] <= dist["p90"] <= dist["p95"] <= dist["p99"] <= dist["max"]
    assert report["latency_ms"]["ttft"]["count"] == 20
    assert report["latency_ms"]["ttft"]["max"] <= report["latency_ms"]["e2e"]["max"]
    assert report["goodput"]["good_requests"] == 20  # the SLOs are a minute: all within
    assert json.loads(proc.stdout.strip().splitlines()[-1])["completed"] == 20
    assert max(b["mean_in_flight"] for b in report["timeline"]) <= 4 + 1e-9
    for name in ("latency_cdf.png", "throughput_over_time.png", "latency_over_time.png"):
        width, height = _png_size(tmp_path / name)
        assert width > 400 and height > 300
    assert f"report: {tmp_path / 'report.json'}" in proc.stdout
    assert "TTFT" in proc.stdout and "20 completed, 0 failed" in proc.stdout
    assert "20/20 done" in proc.stderr  # the progress line, plain since stderr is a pipe


def test_bench_chat_at_a_rate(stack: Stack, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n'
                       '{"prompt": "the quick brown fox jumps over the lazy dog", '
                       '"max_tokens": 3}\n')
    proc, report = _bench(stack, tmp_path, "--endpoint", "chat", "--rate", "20", "--arrivals",
                          "bursty", "--num-requests", "6", "--prompts", str(prompts),
                          "--output-len", "5", "--no-plots")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert report["requests"]["completed"] == 6
    assert sorted(r["output_tokens"] for r in report["per_request"]) == [3, 3, 3, 5, 5, 5]
    assert report["config"]["gamma_shape"] == 0.25 and report["goodput"] is None
    assert not list(tmp_path.glob("*.png"))


def test_shared_prefix_prompts_share_their_prefix_tokens(stack: Stack) -> None:
    """With the real tokenizer: the prompts of one prefix share exactly its tokens, and each
    prompt has the length asked."""
    assert stack.router is not None

    async def vocab() -> tuple[str, ...]:
        async with aiohttp.ClientSession() as session:
            count = tokens.server_counter(session, stack.router.url, "tiny", None)
            return await tokens.one_token_words(count, WORDS)

    w = Workload(LengthDist(4, 4), LengthDist(3, 12), seed=1, shared=SharedPrefix(3, 20),
                 vocab=asyncio.run(vocab()))
    ids = [_tokenize(stack, {"prompt": w.request(i).prompt, "add_special_tokens": False})
           ["tokens"] for i in range(9)]
    assert [len(t) for t in ids] == [w.request(i).prompt_len for i in range(9)]
    heads = [tuple(t[:20]) for t in ids]
    assert len(set(heads)) == 3 and all(heads[i] == heads[i % 3] for i in range(9))


def test_shared_prefixes_are_read_from_the_kv_store(stack: Stack, tmp_path: Path) -> None:
    """`--shared-prefix` against the real stack: the KV store's hit rate, read from the
    workers' /metrics, shows the prefixes reused; unique prompts of the same length show none."""
    proc, shared = _bench(stack, tmp_path / "shared", "--shared-prefix", "2", "--prefix-len",
                          "64", "--suffix-len", "8", "--num-requests", "8", "--num-warmups",
                          "1", "--output-len", "2", "--no-plots")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    server = shared["server"]
    assert server["workers_scraped"] == 2 and shared["warmup"]["completed"] == 1
    # Requests 2..7 find their prefix's 4 full blocks in the store (0 and 1 wrote them).
    assert server["kv_store_prefix_blocks"] >= 6 * 4
    assert 0.4 < server["kv_store_hit_rate"] <= 1.0
    proc, unique = _bench(stack, tmp_path / "unique", "--prompt-len", "72", "--num-requests",
                          "8", "--output-len", "2", "--no-plots")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert unique["server"]["kv_store_hit_rate"] < 0.1
