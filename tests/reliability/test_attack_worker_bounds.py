"""Attack: one request to a worker's internal API that costs it far more than its size
(issue 15), against a real worker process with a real Redis.

Before: ``earlier_token_ids`` of any length were replayed one token at a time on the engine
thread (about 7.6 us a token, so the million here froze it for seconds while /health said ok);
the store lookup ran before the prompt-length check and sized a zero-filled read buffer by the
prompt; stop strings were unbounded (quadratic holdback); deep JSON answered 500. Now each is
refused with a 4xx before any store lookup or engine work. The figure gives each attack's
bytes and the time its refusal took; the store counters show no lookup, and a normal request
is served straight after.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from attack_support import scrape
from figures import report
from serving_stack import start_stack

from cleave.common.settings import INTERNAL_TOKEN_ENV
from cleave.runtime.serving.protocol import MAX_STOP, MAX_STOP_CHARS

TOKEN = "the-service-internal-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
PROMPT = [5, 6, 7, 8]


def _json(body: object) -> bytes:
    return json.dumps(body).encode()


ATTACKS: dict[str, bytes] = {
    "earlier_token_ids_1M": _json({"prompt_token_ids": PROMPT, "first_token": 9,
                                   "earlier_token_ids": [9] * 1_000_000,
                                   "sampling": {"max_tokens": 16}}),
    "prompt_100K_tokens": _json({"prompt_token_ids": [9] * 100_000,
                                 "sampling": {"max_tokens": 1}}),
    "stop_4x250K_chars": _json({"prompt_token_ids": PROMPT, "sampling": {
        "max_tokens": 16, "stop": ["ab" * 125_000 + str(i) for i in range(4)]}}),
    "stop_count": _json({"prompt_token_ids": PROMPT, "sampling": {
        "max_tokens": 16, "stop": [str(i) for i in range(MAX_STOP + 1)]}}),
    "stop_one_char_too_long": _json({"prompt_token_ids": PROMPT, "sampling": {
        "max_tokens": 16, "stop": ["x" * (MAX_STOP_CHARS + 1)]}}),
    "json_nested_100K": b"[" * 100_000 + b"]" * 100_000,
}


def post(url: str, body: bytes) -> tuple[int, float, bytes]:
    start = time.perf_counter()
    req = urllib.request.Request(url, data=body, method="POST", headers=AUTH)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out, status = r.read(), int(r.status)
    except urllib.error.HTTPError as e:
        out, status = e.read(), int(e.code)
    return status, time.perf_counter() - start, out


def test_costly_internal_requests_are_refused_before_any_work(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    stack = start_stack(tiny_model_dir, tmp_path, prefill=0, decode=1)
    try:
        worker = stack.workers[0]
        figures: dict[str, dict[str, float]] = {}
        for name, body in ATTACKS.items():
            before = scrape(worker)
            status, seconds, answer = post(worker.url + "/internal/generate", body)
            assert status in (400, 413), (name, status, answer[:200])
            assert "error" in json.loads(answer), name
            assert scrape(worker) == before, name  # no store lookup
            figures[name] = {"bytes": len(body), "status": status,
                             "refused_ms": round(seconds * 1e3, 1)}
        status, seconds, answer = post(worker.url + "/internal/generate", _json(
            {"prompt_token_ids": PROMPT, "sampling": {"max_tokens": 4}}))
        assert status == 200 and answer.count(b"\n") >= 1  # NDJSON: the worker still serves
        report("attack_worker_bounds", served_after_ms=round(seconds * 1e3, 1), **figures)
        assert all(f["refused_ms"] < 5000 for f in figures.values()), figures
    finally:
        stack.stop()
