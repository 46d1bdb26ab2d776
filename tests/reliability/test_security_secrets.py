"""Security: the API key and the Redis password, on a real ``cleave up``.

An API key given in ``CLEAVE_API_KEY`` is required on every ``/v1/`` request (an OpenAI-shaped
401 without it or with a wrong one) and compared with ``hmac.compare_digest``; a Redis with
``requirepass`` works with the password in the URL, a wrong password is a clear error rather
than a hang, and neither secret ever reaches a log (at DEBUG level, every process's), an HTTP
answer (error answers included) or a command line of any process ``cleave up`` starts.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from figures import report
from redis_servers import RedisServer, closed_port, start_server
from serving_stack import post_raw
from transformers import AutoTokenizer
from up_stack import UpProcess, descendants, get_ok, metric_total, running_up

from cleave.common import metric_names as names
from cleave.runtime.serving import router as router_module
from cleave.runtime.serving.router import Router, RouterConfig

API_KEY = "ck-" + secrets.token_hex(16)  # fresh each run: finding it in a log means a leak
REDIS_PASSWORD = "rp-" + secrets.token_hex(16)
INTERNAL_TOKEN = "it-" + secrets.token_hex(16)  # the workers' /internal/* key, given to cleave up
LONG_PROMPT = "the engineer builds many books before dinner " * 6  # disaggregated
DEBUG_SITE = Path(__file__).parent / "debug_logging"  # its sitecustomize forces DEBUG logs
# A wrong password costs one failed AUTH per worker, not a retry loop: each worker says so
# within this long of listening (one attempt is bounded by the store's 1 s connect and 2 s call
# timeouts; the rest is slack for a loaded 2-core box). Measured inside each worker, from its
# own log's timestamps, so a slow torch import elsewhere on the box cannot fail it.
STORE_PROBE_BOUND_SECONDS = 15.0
_STAMPED = re.compile(r"^\[ *(\w+-\d+)\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[RedisServer]:
    server = start_server(password=REDIS_PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               redis_with_password: RedisServer) -> Iterator[UpProcess]:
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_with_password.port}/0"
    path = os.pathsep.join(p for p in (str(DEBUG_SITE), os.environ.get("PYTHONPATH")) if p)
    with running_up(tiny_model_dir, tmp_path_factory.mktemp("guarded"), prefill=1, decode=1,
                    redis_url=url, env={"CLEAVE_API_KEY": API_KEY, "PYTHONPATH": path,
                                        "CLEAVE_INTERNAL_TOKEN": INTERNAL_TOKEN}) as up:
        yield up


BODY = json.dumps({"model": "x", "prompt": "hi", "max_tokens": 2}).encode()


def test_an_api_key_is_required_and_a_wrong_one_is_refused(guarded_up: UpProcess) -> None:
    url = guarded_up.base_url + "/completions"
    refused = [{}, {"Authorization": ""}, {"Authorization": f"Bearer {API_KEY[:-1]}"},
               {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"Basic {API_KEY}"},
               {"Authorization": f"Bearer {API_KEY[:-1]}{'0' if API_KEY[-1] != '0' else '1'}"}]
    for headers in refused:
        status, body = post_raw(url, BODY, headers)
        assert status == 401, headers
        error = body["error"]
        assert isinstance(error, dict)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert isinstance(error["message"], str) and API_KEY not in json.dumps(body)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_up.base_url, api_key="not-the-key",
                      max_retries=0).models.list()
    for probe in ("/health", "/ready", "/metrics"):  # open to probes and scrapers
        assert get_ok(f"http://127.0.0.1:{guarded_up.port}{probe}"), probe


def test_the_right_key_is_served_through_a_redis_that_wants_a_password(
        guarded_up: UpProcess, redis_with_password: RedisServer) -> None:
    client = openai.OpenAI(base_url=guarded_up.base_url, api_key=API_KEY, max_retries=0,
                           timeout=60)
    for _ in range(2):
        chunks = list(client.completions.create(
            model=guarded_up.model, prompt=LONG_PROMPT, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
            # Sampled from a random model, an end-of-text token could come first (it did):
            # the count is exact only without it.
            extra_body={"ignore_eos": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    for worker in guarded_up.workers():
        with urllib.request.urlopen(worker.url + "/ready", timeout=5) as r:
            assert json.loads(r.read())["store"] == "ok", worker
    # The prefill worker saved the prompt's blocks in Redis, and the decode worker read them.
    assert redis_with_password.client().dbsize() > 0
    decode = guarded_up.worker("decode-0")
    assert metric_total(decode.url, names.total(names.STORE_HITS)) > 0


def _error_answers(up: UpProcess) -> list[str]:
    """The router's answers to requests that fail, with the right key and a wrong one."""
    right = {"Authorization": f"Bearer {API_KEY}"}
    bad = [(BODY, {"Authorization": "Bearer wrong"}),
           (b"{not json", right),
           (json.dumps({"model": "x", "prompt": "hi", "max_tokens": -1}).encode(), right),
           (json.dumps({"model": "x", "prompt": "hi " * 5000, "max_tokens": 2}).encode(), right),
           (json.dumps({"model": "x", "prompt": "hi", "temperature": "hot"}).encode(), right)]
    answers = []
    for body, headers in bad:
        status, answer = post_raw(up.base_url + "/completions", body, headers)
        assert status >= 400, (status, answer)
        answers.append(json.dumps(answer))
    return answers


def test_no_secret_reaches_a_log_or_an_answer(guarded_up: UpProcess,
                                              redis_with_password: RedisServer) -> None:
    openai.OpenAI(base_url=guarded_up.base_url, api_key=API_KEY, max_retries=0).completions \
        .create(model=guarded_up.model, prompt=LONG_PROMPT, max_tokens=2)
    pages = _error_answers(guarded_up)
    log = guarded_up.log_text()
    assert " DEBUG " in log or "DEBUG:" in log, "the processes did not log at DEBUG"
    pages += [log, redis_with_password.log_tail(10_000)]
    for worker in guarded_up.workers():
        for path in ("/ready", "/internal/stats", "/metrics", "/health"):
            request = urllib.request.Request(
                worker.url + path, headers={"Authorization": f"Bearer {INTERNAL_TOKEN}"})
            with urllib.request.urlopen(request, timeout=5) as r:
                pages.append(r.read().decode())
    router = f"http://127.0.0.1:{guarded_up.port}"
    for path in ("/ready", "/metrics", "/openapi.json"):
        with urllib.request.urlopen(router + path, timeout=5) as r:
            pages.append(r.read().decode())
    # ps shows command lines to every user: the password travels in the environment. Every
    # process under cleave up, at any depth (a worker's own helpers too).
    commands = descendants(guarded_up.proc.pid)
    assert len(commands) >= 3, commands  # the router and both workers at least
    pages += list(commands.values())
    for secret in (API_KEY, REDIS_PASSWORD, INTERNAL_TOKEN):
        leaks = [page[max(0, page.find(secret) - 200):page.find(secret) + 50]
                 for page in pages if secret in page]
        assert not leaks, leaks[:2]
    report("security_secrets", pages_checked=len(pages), processes=len(commands),
           log_lines=log.count("\n"))


def test_a_wrong_redis_password_is_a_clear_error_not_a_hang(
        tiny_model_dir: Path, tmp_path: Path, redis_with_password: RedisServer) -> None:
    wrong = "wrong-" + secrets.token_hex(8)
    began = time.monotonic()
    with running_up(tiny_model_dir, tmp_path, prefill=1, decode=1,
                    redis_url=f"redis://:{wrong}@127.0.0.1:{redis_with_password.port}/0") as up:
        came_up = time.monotonic() - began
        reply = openai.OpenAI(base_url=up.base_url, api_key="-", max_retries=0, timeout=30) \
            .completions.create(model=up.model, prompt=LONG_PROMPT, max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens == 4  # recomputed
        for worker in up.workers():
            with urllib.request.urlopen(worker.url + "/ready", timeout=5) as r:
                store = json.loads(r.read())["store"]
            assert store.startswith("unavailable (recomputing)"), store
            assert "AuthenticationError" in store or "WRONGPASS" in store, store
        log = up.log_text()
    startup = [line for line in log.splitlines() if "the KV store is unavailable" in line]
    assert len(startup) == 2 and all("Authentication" in line for line in startup), startup
    assert wrong not in log and REDIS_PASSWORD not in log
    probes = _store_probe_seconds(log)
    assert sorted(probes) == ["decode-0", "prefill-0"], probes
    assert all(s < STORE_PROBE_BOUND_SECONDS for s in probes.values()), probes
    report("security_wrong_redis_password", came_up_s=round(came_up, 1),
           store_probe_s={w: round(s, 2) for w, s in probes.items()}, ready_store=store[:100])


def _store_probe_seconds(log: str) -> dict[str, float]:
    """Per worker: seconds from "worker listening" to its "the KV store is unavailable"."""
    listening: dict[str, datetime.datetime] = {}
    probes: dict[str, float] = {}
    for line in log.splitlines():
        stamped = _STAMPED.match(line)
        if stamped is None:
            continue
        worker, at = stamped[1], datetime.datetime.strptime(stamped[2], "%Y-%m-%d %H:%M:%S,%f")
        if "worker listening on" in line:
            listening[worker] = at
        elif "the KV store is unavailable" in line and worker in listening:
            probes[worker] = (at - listening[worker]).total_seconds()
    return probes


@pytest.fixture
async def router_client(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    config = RouterConfig(model="tiny", decode_urls=(f"http://127.0.0.1:{closed_port()}",),
                          api_key=API_KEY)
    router = Router(config, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 512, 512)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    yield client
    await client.close()


async def test_the_key_is_compared_by_hmac_compare_digest_alone(
        router_client, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Constant time by construction: the router's only decision is compare_digest's answer."""
    calls: list[tuple[bytes, bytes]] = []
    verdict: list[bool | None] = [None]
    real = router_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b) if verdict[0] is None else verdict[0]

    monkeypatch.setattr(router_module.hmac, "compare_digest", spy)

    async def status(key: str) -> int:
        response = await router_client.get("/v1/models",
                                           headers={"Authorization": f"Bearer {key}"})
        return int(response.status)

    assert await status(API_KEY) == 200 and await status("wrong") == 401
    assert calls == [(API_KEY.encode(), API_KEY.encode()), (b"wrong", API_KEY.encode())]
    verdict[0] = True  # a wrong key now passes: nothing but compare_digest decides
    assert await status("wrong") == 200
    verdict[0] = False
    assert await status(API_KEY) == 401
    assert len(calls) == 4
