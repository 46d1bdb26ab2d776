"""The workers' internal API needs the service's token (issue 15): real ``cleave`` processes.

Before, any process that reached a worker's port could call /internal/generate and skip the
router's API key, its concurrency limit and its validation.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from serving_stack import CLI, post_raw, spawn, start_stack

from cleave.common.settings import INTERNAL_TOKEN_ENV

TOKEN = "t0ken-of-the-service"
BODY = b'{"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}'


def _get(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:  # not listening yet
        return 0


def test_workers_serve_the_router_and_refuse_callers_without_the_token(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)  # what cleave up and the operator give both
    stack = start_stack(tiny_model_dir, tmp_path, prefill=0, decode=1)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="-", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert out.usage.completion_tokens == 2  # the router's calls carry the token
        worker = stack.workers[0].url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            assert post_raw(worker + "/internal/generate", BODY, headers)[0] == 401
            assert _get(worker + "/internal/stats", headers) == 401
            assert post_raw(worker + "/internal/prefill", BODY, headers)[0] == 401
        assert post_raw(worker + "/internal/role", b'{"role": "prefill"}')[0] == 401
        assert _get(worker + "//internal/stats") == 401  # an odd spelling is no way round
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert _get(worker + "/internal/stats", ok) == 200
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapes carry no token
            assert _get(worker + path) == 200

        # A router holding another token is refused by the worker: it serves nothing.
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not-the-token\n")
        router = spawn("router-wrong", ["router", "--model", stack.model,
                                        "--served-model-name", "tiny", "--decode", worker,
                                        "--internal-token-file", str(wrong)], tmp_path)
        try:
            status = 0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and status != 503:
                status = post_raw(router.url + "/v1/completions",
                                  b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}')[0] \
                    if _get(router.url + "/health") == 200 else 0
                time.sleep(0.2)
            assert status == 503
            assert "refused the internal token" in router.log.read_text()
        finally:
            router.stop()
    finally:
        stack.stop()


def test_a_worker_reachable_beyond_loopback_needs_a_token(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_ENV}
    done = subprocess.run([*CLI, "worker", "--host", "0.0.0.0", "--model", str(tiny_model_dir),
                           "--check"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "needs an internal token" in done.stderr
