"""Scale from zero in the router: workers that come and go through a workers file, requests
held while no decode worker is ready, and a 503 with Retry-After when none turns ready in time.

Real processes (the router and a worker, tiny model) for the serving paths; the file format
and the pool's drain bookkeeping are checked directly.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from local_autoscale_support import wait_for
from serving_stack import Proc, spawn, wait_ready

from cleave.common import metric_names as names
from cleave.runtime.serving.membership import parse_members, write_members
from cleave.runtime.serving.upstream import WorkerPool


def _router(model: Path, logdir: Path, workers_file: Path, hold: float) -> Proc:
    return spawn("router", ["router", "--model", str(model), "--served-model-name", "tiny",
                            "--workers-file", str(workers_file), "--hold-timeout", str(hold)],
                 logdir)


def _held(router: Proc) -> float:
    text = urllib.request.urlopen(router.url + "/metrics", timeout=5).read().decode()
    match = re.search(rf'^{names.WAITING}\{{role="router"\}} (\S+)$', text, re.M)
    assert match, "the router exports its held requests"
    return float(match.group(1))


def _listed(router: Proc) -> list[str]:
    body = json.loads(urllib.request.urlopen(router.url + "/internal/workers", timeout=5).read())
    return [w["url"] for w in body["decode"]]


def test_a_request_is_held_until_a_first_worker_is_ready(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    members = tmp_path / "workers.json"
    write_members(members, {"decode": []})
    router = _router(tiny_model_dir, tmp_path, members, hold=120)
    worker: Proc | None = None
    try:
        wait_ready(router)  # ready with no worker: it takes requests and holds them
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="-", max_retries=0,
                               timeout=150)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        outcome: dict[str, object] = {}

        def ask() -> None:
            try:
                outcome["reply"] = client.completions.create(model="tiny", prompt="hello world",
                                                             max_tokens=4, temperature=0)
            except Exception as e:  # reported by the assertion below
                outcome["error"] = e

        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(lambda: _held(router) == 1, 30, "the request counted as waiting")
        assert asking.is_alive() and not outcome, "held, not answered"
        worker = spawn("both-0", ["worker", "--role", "both", "--model", str(tiny_model_dir),
                                  "--dtype", "float32", "--kv-cache-memory", "8MiB",
                                  "--grace-period", "5"], tmp_path)
        wait_ready(worker)
        assert asking.is_alive(), "not served before the router knows the worker"
        write_members(members, {"decode": [worker.url]})
        asking.join(timeout=60)
        assert "error" not in outcome, outcome
        reply = outcome["reply"]
        assert isinstance(reply, openai.types.Completion)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert _held(router) == 0
        # Out of the file, out of the router's list (it had nothing open there).
        write_members(members, {"decode": []})
        wait_for(lambda: _listed(router) == [], 10, "the worker forgotten")
    finally:
        if worker is not None:
            worker.stop()
        router.stop()


def test_a_hold_that_times_out_is_a_503_with_retry_after(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    members = tmp_path / "workers.json"
    members.write_text("not json")  # unreadable: logged, and the router starts with none
    router = _router(tiny_model_dir, tmp_path, members, hold=1.5)
    try:
        wait_ready(router)
        request = urllib.request.Request(
            router.url + "/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"})
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        waited = time.monotonic() - started
        assert refused.value.code == 503
        assert refused.value.headers["Retry-After"] == "1"
        error = json.loads(refused.value.read())["error"]
        assert error["type"] == "service_unavailable" and "within 1.5 s" in error["message"]
        assert 1.5 <= waited < 15
        assert _held(router) == 0
        assert "workers file" in router.log.read_text() and "not JSON" in router.log.read_text()
    finally:
        router.stop()


# -- the pieces, directly -----------------------------------------------------------------

def test_workers_file_round_trips_and_bad_ones_say_why(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    write_members(path, {"prefill": ["http://a:1/"], "decode": ["http://b:2", "http://c:3"]})
    assert parse_members(path.read_text()) == {"prefill": ("http://a:1",),
                                               "decode": ("http://b:2", "http://c:3")}
    assert parse_members("{}") == {"prefill": (), "decode": ()}
    assert list(tmp_path.iterdir()) == [path], "no temporary file left behind"
    for text, why in [("[]", "expected an object"), ('{"both": []}', "unknown roles"),
                      ('{"decode": ["b:2"]}', "http(s):// URLs"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_members(text)


async def test_a_delisted_worker_gets_no_new_requests_and_leaves_when_idle() -> None:
    async with aiohttp.ClientSession() as session:
        pool = WorkerPool([], session)
        assert not pool
        pool.set_listed(["http://w1", "http://w2"])
        assert {w.url for w in pool.snapshot()} == {"http://w1", "http://w2"}
        assert not any(w.healthy for w in pool.snapshot()), "down until its first poll"
        with pool.track("http://w2"):
            pool.set_listed(["http://w1"])  # w2 leaves while a request is open on it
            [w2] = [w for w in pool.describe() if w["url"] == "http://w2"]
            assert w2["leaving"] and not w2["healthy"] and w2["inflight"] == 1
            pool.set_listed(["http://w1"])
            assert "http://w2" in {w["url"] for w in pool.describe()}, "kept while busy"
        pool.set_listed(["http://w1"])
        assert [w["url"] for w in pool.describe()] == ["http://w1"]
        pool.set_listed(["http://w1", "http://w2"])  # and it may come back
        assert not [w for w in pool.describe() if w["leaving"]]
