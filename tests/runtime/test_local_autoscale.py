"""``cleave up --autoscale``: the policy really starts and stops worker processes.

Each test runs the real ``cleave up`` with the tiny model and short intervals and windows, and
checks three views that must agree: the decision lines in the log, the worker processes under
``cleave up``, and the router's own list of workers. Every test ends with a Ctrl-C that must
leave no process behind.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
from local_autoscale_support import CLI, Up, wait_for

FAST = ("--autoscale", "--autoscale-interval", "0.5", "--metrics-window", "2")


def _load(up: Up, stop: threading.Event) -> None:
    """Streams back to back: every output token is a TPOT sample."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="-", max_retries=0, timeout=60)
    while not stop.is_set():
        try:
            for _ in client.completions.create(model=up.model, prompt="hello " * 8,
                                               max_tokens=24, stream=True, temperature=0):
                pass
        except openai.APIError:
            time.sleep(0.1)  # a worker draining or starting; keep the load on


def test_load_starts_a_second_worker_and_idleness_drains_it(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    # A TPOT target no CPU can meet: any decode traffic asks for more workers.
    up = Up(tiny_model_dir, tmp_path, "--prefill", "0", "--decode", "1", *FAST,
            "--decode-max", "2", "--tpot-slo", "0.00001", "--kv-watermark", "0",
            "--scale-down-window", "2")
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(up, stop)) for _ in range(2)]
    try:
        up.wait_up()
        assert len(up.worker_pids()) == 1 and up.healthy("decode") == 1
        for t in loaders:
            t.start()
        wait_for(lambda: len(up.worker_pids()) == 2 and up.healthy("decode") == 2, 120,
                 "a second worker process, in the router's list", up.log)
        assert re.search(r"autoscale both 1 -> 2: tpot asks for \d+;.*latency_p90=[0-9.e-]+ "
                         r"latency_target=1e-05", up.log())
        stop.set()
        for t in loaders:
            t.join(timeout=60)
        wait_for(lambda: len(up.worker_pids()) == 1 and len(up.router_workers()["decode"]) == 1,
                 90, "back to one worker once idle", up.log)
        log = up.log()
        assert "autoscale both 2 -> 1: idle: no queue and no tokens" in log
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
        assert "autoscale prefill 1 -> 0" in log and "autoscale decode 1 -> 0" in log
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
        assert re.search(r"autoscale decode 0 -> 1: demand while at zero.*queue_depth=1", log)
        assert "autoscale prefill 0 -> 1" in log  # zero is all or nothing: both roles wake
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
        line = "autoscale (advisory, not applied) both 1 -> 0: idle"
        wait_for(lambda: line in up.log(), 60, "the advisory decision", up.log)
        assert "advisory (decisions are logged, nothing changes)" in up.log()
        # Several more intervals: still the same one worker, and the decision logged once.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert up.worker_pids() == [pid] and up.healthy("decode") == 1
            time.sleep(0.25)
        assert up.log().count(line) == 1
        assert "starting both-" not in up.log() and "draining" not in up.log()
        up.ctrl_c_leaves_nothing()
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
])
def test_bad_autoscale_flags_are_refused_before_anything_starts(args: list[str],
                                                                message: str) -> None:
    done = subprocess.run([*CLI, "up", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert "preparing model" not in done.stdout
