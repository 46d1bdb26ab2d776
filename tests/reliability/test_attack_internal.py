"""Attack: call the workers' internal API directly, without the service's token (issue 15).

Before, any pod that reached a worker's port could call /internal/generate or /internal/prefill
and skip the router's API key, its concurrency limit and its validation, or flip a worker's
role. Now every /internal/* path wants ``Authorization: Bearer <token>``. Here a real stack
(router, a prefill and a decode worker, started with a token) gets every internal endpoint the
worker defines called on both workers with no token, a wrong one, the token without "Bearer"
and as Basic credentials: every call must be refused (401/403), and the same calls with the
right token must work. The figure also times a refusal against the same call served.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from figures import report
from serving_stack import start_stack

from cleave.common.settings import INTERNAL_TOKEN_ENV
from cleave.runtime.serving import worker

TOKEN = "the-service-internal-token"
GENERATE = b'{"prompt_token_ids": [1, 2, 3, 4], "sampling": {"max_tokens": 8}}'
PREFILL = b'{"prompt_token_ids": [1, 2, 3, 4], "sampling": {"max_tokens": 1}}'
CREDENTIALS: tuple[dict[str, str], ...] = (
    {}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer "})


def internal_routes() -> list[tuple[str, str]]:
    """(method, path) of every /internal/* route the worker registers: read from its source,
    so that an endpoint added later is attacked here too."""
    return [(m.upper(), p) for m, p in re.findall(r'add_(get|post)\("(/internal/[^"]+)"',
                                                  inspect.getsource(worker))]


def call(method: str, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, float]:
    req = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            status = int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        status = int(e.code)
    return status, time.perf_counter() - start


def _body(path: str, role: str) -> bytes:
    if path.endswith("/role"):
        return b'{"role": "%s"}' % role.encode()  # its own home role: no change when allowed
    return PREFILL if path.endswith("/prefill") else GENERATE


def test_every_internal_call_without_the_token_is_refused(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    routes = internal_routes()
    assert {p for _, p in routes} >= {"/internal/generate", "/internal/prefill",
                                      "/internal/stats", "/internal/role"}
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    stack = start_stack(tiny_model_dir, tmp_path, prefill=1, decode=1)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="-", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello " * 20, max_tokens=4)
        assert out.usage.completion_tokens == 4  # the router's own calls carry the token
        attempted = refused = 0
        refused_s: list[float] = []
        for w in stack.workers:
            role = "prefill" if w.name.startswith("prefill") else "decode"
            for method, path in routes:
                for headers in CREDENTIALS:
                    status, seconds = call(method, w.url + path, _body(path, role), headers)
                    attempted += 1
                    refused += status in (401, 403)
                    assert status in (401, 403), (w.name, path, headers, status)
                    if path == "/internal/generate":
                        refused_s.append(seconds)
        ok = {"Authorization": f"Bearer {TOKEN}"}
        served_s: list[float] = []
        for w in stack.workers:
            role = "prefill" if w.name.startswith("prefill") else "decode"
            for method, path in routes:
                if path == "/internal/prefill" and role != "prefill":
                    continue  # a decode worker's prefill is the router's business, not ours
                status, seconds = call(method, w.url + path, _body(path, role), ok)
                assert status == 200, (w.name, path, status)
                if path == "/internal/generate":
                    served_s.append(seconds)
        report("attack_internal_calls", endpoints=len(routes), workers=len(stack.workers),
               credentials_tried=len(CREDENTIALS), attempted=attempted, refused=refused,
               served_without_token=attempted - refused,
               refused_generate_ms=round(statistics.median(refused_s) * 1e3, 2),
               served_generate_ms=round(statistics.median(served_s) * 1e3, 2))
        assert refused == attempted > 0
    finally:
        stack.stop()
