"""``cleave up --autoscale``: the policy really starts and stops worker processes.

Each test runs the real ``cleave up`` with the tiny model and short intervals and windows, and
checks three views that must agree: the decision lines in the log, the worker processes under
``cleave up``, and the router's own list of workers. Every test ends with a Ctrl-C that must
leave no process behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from local_autoscale_support import CLI, Up, wait_for
from transformers import AutoTokenizer

from cleave.autoscaling.policy import DECODE, PolicyConfig, RolePolicy
from cleave.common import metric_names as names
from cleave.common.settings import WorkerSettings
from cleave.runtime.serving import http_server
from cleave.runtime.serving.autoscale_settings import AutoscaleSettings
from cleave.runtime.serving.local_autoscale import LocalAutoscaler
from cleave.runtime.serving.local_processes import DRAINING, STARTING, Supervisor
from cleave.runtime.serving.membership import parse_members, write_members
from cleave.runtime.serving.router import Router, RouterConfig

FAST = ("--autoscale", "--autoscale-interval", "0.5", "--metrics-window", "2")


def _load(up: Up, stop: threading.Event, errors: list[str]) -> None:
    """Streams back to back: every output token is a TPOT sample. A worker that starts (not
    listed until ready) or drains (delisted first) must fail none of them: they are noted."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="-", max_retries=0, timeout=60)
    while not stop.is_set():
        try:
            for _ in client.completions.create(model=up.model, prompt="hello " * 8,
                                               max_tokens=24, stream=True, temperature=0):
                pass
        except openai.APIError as e:
            errors.append(f"{type(e).__name__}: {e}")
            time.sleep(0.1)  # keep the load on; the assertion below reports it


def test_load_starts_a_second_worker_and_idleness_drains_it(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    # A TPOT target no CPU can meet: any decode traffic asks for more workers.
    up = Up(tiny_model_dir, tmp_path, "--prefill", "0", "--decode", "1", *FAST,
            "--decode-max", "2", "--tpot-slo", "0.00001", "--kv-watermark", "0",
            "--scale-down-window", "2")
    stop = threading.Event()
    errors: list[str] = []
    loaders = [threading.Thread(target=_load, args=(up, stop, errors)) for _ in range(2)]
    try:
        up.wait_up()
        assert len(up.worker_pids()) == 1 and up.healthy("decode") == 1
        for t in loaders:
            t.start()
        wait_for(lambda: len(up.worker_pids()) == 2 and up.healthy("decode") == 2, 120,
                 "a second worker process, in the router's list", up.log)
        assert re.search(r"autoscaler scale both 1 -> 2 \(tpot asks for \d+;.*"
                         r"latency_p90=[0-9.e-]+ .*latency_target=1e-05", up.log())
        stop.set()
        for t in loaders:
            t.join(timeout=60)
        assert not errors, errors[:3]
        # The supervisor logs the exit after it reaps the process: wait for the line too.
        wait_for(lambda: len(up.worker_pids()) == 1 and len(up.router_workers()["decode"]) == 1
                 and "stopped (exit code" in up.log(), 90, "back to one worker once idle", up.log)
        log = up.log()
        assert "autoscaler scale both 2 -> 1 (idle: no queue and no tokens" in log
        # The newest goes, drained: out of the router's list first, then a clean exit.
        assert "draining both-1" in log and "both-1 stopped (exit code 0)" in log
        up.ctrl_c_leaves_nothing()
    finally:
        stop.set()
        up.kill()


def test_scale_to_zero_then_a_request_wakes_both_roles(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    up = Up(tiny_model_dir, tmp_path, "--prefill", "1", "--decode", "1", *FAST,
            "--scale-to-zero", "--scale-down-window", "1", "--hold-timeout", "120")
    try:
        up.wait_up()
        wait_for(lambda: not up.worker_pids() and not any(up.router_workers()[r]
                                                          for r in ("prefill", "decode")),
                 90, "every worker stopped while idle", up.log)
        log = up.log()
        assert "autoscaler scale prefill 1 -> 0" in log and "autoscaler scale decode 1 -> 0" in log
        # At zero the model is still listed, and a request is held, not refused.
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="-", max_retries=0,
                               timeout=150)
        assert [m.id for m in client.models.list().data] == [up.model]
        started = time.monotonic()
        reply = client.completions.create(model=up.model, prompt="the quick brown fox " * 6,
                                          max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        log = up.log()
        assert re.search(r"autoscaler scale decode 0 -> 1 \(demand while at zero.*"
                         r"queue_depth=1", log)
        assert "autoscaler scale prefill 0 -> 1" in log  # zero is all or nothing: both roles wake
        assert time.monotonic() - started < 120
        up.ctrl_c_leaves_nothing()
    finally:
        up.kill()


def test_advisory_logs_the_decision_and_changes_nothing(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    up = Up(tiny_model_dir, tmp_path, "--prefill", "0", "--decode", "1", *FAST,
            "--advisory", "--scale-to-zero", "--scale-down-window", "0")
    try:
        up.wait_up()
        [pid] = up.worker_pids()
        line = "autoscaler advisory both 1 -> 0 (idle"
        wait_for(lambda: line in up.log(), 60, "the advisory decision", up.log)
        assert "advisory (decisions are logged, nothing changes)" in up.log()
        # Several more intervals: still the same one worker, and the decision logged once.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert up.worker_pids() == [pid] and up.healthy("decode") == 1
            time.sleep(0.25)
        assert up.log().count(line) == 1
        assert "starting both-" not in up.log() and "draining" not in up.log()
        # The decision is also in the metrics and the status file the start line names.
        told = re.search(r"autoscaler metrics on (\S+); its last decisions in (\S+)", up.log())
        assert told is not None
        with urllib.request.urlopen(told[1], timeout=5) as r:
            exposed = r.read().decode()
        assert (f'{names.AUTOSCALER_DESIRED}{{advisory="true",llmservice="cleave-up",'
                'namespace="local",role="both"} 0.0') in exposed
        block = json.loads(Path(told[2]).read_text())
        assert block["dryRun"] is True and block["decisions"][0]["desired"] == 0
        up.ctrl_c_leaves_nothing()
        assert not Path(told[2]).exists()  # live state: gone with cleave up
    finally:
        up.kill()


@pytest.mark.parametrize(("args", "message"), [
    (["--decode-max", "3"], "--decode-max needs --autoscale"),
    (["--advisory"], "--advisory needs --autoscale"),
    (["--autoscale", "--decode-min", "3", "--decode-max", "2"],
     "need 0 <= --decode-min (3) <= --decode-max (2)"),
    (["--autoscale", "--decode-max", "0"], "--decode-max must be at least 1"),
    (["--autoscale", "--kv-watermark", "1.5"], "--kv-watermark is a ratio"),
    (["--autoscale", "--autoscale-interval", "0"], "must be > 0"),
    (["--autoscale-metrics-port", "9100"], "--autoscale-metrics-port needs --autoscale"),
    (["--autoscale", "--autoscale-metrics-port", "70000"], "must be a TCP port"),
])
def test_bad_autoscale_flags_are_refused_before_anything_starts(args: list[str],
                                                                message: str) -> None:
    done = subprocess.run([*CLI, "up", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert "preparing model" not in done.stdout


# --- the autoscaler's loop against stand-in processes (no model) ----------------------------

# One script plays both parts `cleave up` starts: "router" serves a router's /metrics with two
# requests held (a platform at zero with demand); anything else is a worker that never gets
# ready. Real processes and real HTTP, so the loop runs exactly as under `cleave up`.
STAND_IN = r"""
import http.server, socket, sys, time
from cleave.common import metric_names as names
if sys.argv[1] != "router":
    time.sleep(300)
fd = int(sys.argv[sys.argv.index("--listen-fd") + 1])  # the socket cleave up bound for it
BODY = (f"# TYPE {names.WAITING} gauge\n"
        f'{names.WAITING}{{role="router"}} 2\n').encode()
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Metrics, bind_and_activate=False)
server.socket = socket.socket(fileno=fd)
server.socket.listen()
server.serve_forever()
"""


@pytest.fixture()
def stand_ins(tmp_path: Path) -> Iterator[tuple[Supervisor, list[str]]]:
    lines: list[str] = []
    sup = Supervisor([sys.executable, "-c", STAND_IN], {}, WorkerSettings(),
                     workers_file=tmp_path / "workers.json", say=lines.append)
    sock = http_server.bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sup.start_router(["router"], sock)

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1):
                return True
        except OSError:
            return False

    try:
        wait_for(answers, 30, "the stand-in router's /metrics")
        yield sup, lines
    finally:
        sup.stop_all(grace=5)


def settings(advisory: bool) -> AutoscaleSettings:
    # No latency or KV target: once a worker exists, nothing but demand at zero moves it.
    policy = PolicyConfig({DECODE: RolePolicy(0, 2, down_window_s=60)}, scale_to_zero=True)
    return AutoscaleSettings(policy, {DECODE: "both"}, {DECODE: 0}, interval_s=0.5,
                             metrics_window_s=5, advisory=advisory, hold_timeout_s=60)


@pytest.mark.parametrize("advisory", [True, False], ids=["advisory", "acting"])
async def test_demand_held_at_zero_is_told_once_and_acted_on_once(
        stand_ins: tuple[Supervisor, list[str]], advisory: bool, tmp_path: Path) -> None:
    sup, lines = stand_ins
    status = tmp_path / "autoscaler-status.json"
    flag = "true" if advisory else "false"
    decided_before = _sample(names.total(names.AUTOSCALER_DECISIONS), role="both",
                             direction="up", advisory=flag)
    scaler = LocalAutoscaler(settings(advisory), sup, "http://127.0.0.1:9", None, 5,
                             status_path=status)
    async with aiohttp.ClientSession() as session:
        [first] = await scaler.tick(session)
        assert (first.role, first.current, first.desired) == (DECODE, 0, 1)
        # The history starts from what was up (none here): a seed never delays a scale-up.
        assert scaler.state is not None and scaler.state.history[DECODE][0][1] == 0
        assert first.inputs["queue_depth"] == "2"  # the router's held requests
        for _ in range(3):
            await scaler.tick(session)
    told = [line for line in lines if " 0 -> 1 " in line]
    mode = "advisory" if advisory else "scale"
    assert len(told) == 1 and told[0].startswith(f"cleave up: autoscaler {mode} both 0 -> 1 "
                                                 "(demand while at zero")
    # One worker started when acting, none when advisory, and never a second: a starting
    # worker is capacity on its way.
    assert len(sup.workers(["both"], STARTING)) == (0 if advisory else 1)
    # Told as the operator tells it: the status block (a file here) and its metrics.
    block = json.loads(status.read_text())
    assert block["dryRun"] is advisory and block["desiredReplicas"] == {DECODE: 1}
    [decision] = block["decisions"]
    assert (decision["role"], decision["current"], decision["desired"]) == (DECODE, 0, 1)
    assert "demand while at zero" in decision["reason"]
    assert _sample(names.AUTOSCALER_DESIRED, role="both", advisory=flag) == 1
    assert _sample(names.total(names.AUTOSCALER_DECISIONS), role="both", direction="up",
                   advisory=flag) - decided_before == 1


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, {"llmservice": "cleave-up", "namespace": "local",
                                             **labels})
    return value or 0.0


def test_a_worker_drained_while_it_turned_ready_is_never_listed(
        stand_ins: tuple[Supervisor, list[str]]) -> None:
    """The main thread asks a starting worker's /ready outside the lock; if the autoscaler
    begins draining it meanwhile, the late "ready" must not list it for the router."""
    sup, _ = stand_ins
    worker = sup.spawn_worker("both")
    assert sup.begin_drain(worker) == STARTING
    assert not sup.mark_ready(worker)
    assert worker.state == DRAINING
    assert sup.workers_file is not None
    assert parse_members(sup.workers_file.read_text())["decode"] == ()
    other = sup.spawn_worker("both")
    assert sup.mark_ready(other)
    assert parse_members(sup.workers_file.read_text())["decode"] == (other.url,)


# --- a drain against the real router: never SIGTERM with a request open ----------------------


def slow_worker(gate: asyncio.Event) -> web.Application:
    """A decode worker that sends one token, then waits for ``gate`` before finishing."""
    def line(text: str, finished: bool) -> bytes:
        return json.dumps({"token_ids": [5], "text": text, "finished": finished,
                           "finish_reason": "length" if finished else None,
                           "prompt_tokens": 3, "completion_tokens": 2 if finished else 1,
                           "cached_tokens": 0}).encode() + b"\n"

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"kv_usage": 0.0, "waiting": 0, "draining": False})

    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(line("Hello", False))
        await gate.wait()
        await response.write(line(" world", True))
        return response

    app = web.Application()
    app.router.add_get("/internal/stats", stats)
    app.router.add_post("/internal/generate", generate)
    return app


async def test_a_drain_waits_for_the_request_the_router_has_open_there(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    gate = asyncio.Event()
    worker = TestServer(slow_worker(gate))
    await worker.start_server()
    worker_url = str(worker.make_url("")).rstrip("/")
    members = tmp_path / "workers.json"
    write_members(members, {"decode": [worker_url]})
    config = RouterConfig(model="tiny", workers_file=str(members), hold_timeout_seconds=30,
                          worker_idle_timeout_seconds=60)
    router = TestClient(TestServer(Router(
        config, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 512, 512).app()))
    await router.start_server()
    router_url = str(router.make_url("")).rstrip("/")
    scaler = LocalAutoscaler(settings(advisory=False), Supervisor(["true"], {}, WorkerSettings()),
                             router_url, None, drain_timeout_s=60)
    try:
        async with aiohttp.ClientSession() as session:
            response = await session.post(router_url + "/v1/completions", json={
                "model": "tiny", "prompt": "hi there", "max_tokens": 2, "stream": True})
            assert response.status == 200
            first = await response.content.readline()  # the stream is open on the worker
            assert b"Hello" in first
            write_members(members, {"decode": []})  # the drain's first step
            letting_go = asyncio.create_task(scaler._until_router_lets_go(session, worker_url))
            await asyncio.sleep(3.0)  # several of the router's membership polls
            assert not letting_go.done(), "the router still streams from it: no SIGTERM yet"
            gate.set()
            rest = (await asyncio.wait_for(response.read(), 30)).decode()
            assert "world" in rest and "data: [DONE]" in rest and '"error"' not in rest
            await asyncio.wait_for(letting_go, 15)  # let go once the request is done
    finally:
        gate.set()
        await router.close()
        await worker.close()
