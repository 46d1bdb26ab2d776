"""``cleave up --autoscale`` meets a starved role by flipping a warm worker of the other role
(docs/autoscaling.md, "Elastic roles"), sooner than it can start one; ``--no-flips`` starts one.

The real ``cleave up`` with the tiny model, under a prompt-heavy load whose TTFT target no CPU
meets (prefill asks for its maximum of 2) and whose TPOT target is far off (decode can spare one
of its 2 workers). Both runs must serve every request.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path

import openai
from local_autoscale_support import Up, wait_for

from cleave.runtime.serving.up import said_port

ARGS = ("--autoscale", "--autoscale-interval", "0.5", "--metrics-window", "2",
        "--prefill", "1", "--decode", "2", "--prefill-max", "2", "--decode-min", "1",
        "--decode-max", "2", "--ttft-slo", "0.00001", "--tpot-slo", "10", "--kv-watermark", "0",
        "--scale-down-window", "0")


def _prompt_heavy(up: Up, stop: threading.Event, errors: list[str], offset: int,
                  serving: threading.Event) -> None:
    """Long prompts, four output tokens (the decode side reports TPOT), each prompt new (nothing
    cached): prefill work."""
    # The router's port is said in the "Cleave is up" line, printed before the autoscaler
    # starts: read it as soon as it is there, so the load leads the first decision.
    while (port := said_port(up.log())) is None and not stop.is_set():
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                           timeout=60)
    for i in itertools.count(offset, 2):
        if stop.is_set():
            return
        try:
            client.completions.create(model=up.model, prompt=f"{i} " + "the quick fox " * 20,
                                      max_tokens=4, temperature=0)
        except openai.APIError as e:
            if serving.is_set():  # before cleave up is up, the router may not listen yet
                errors.append(f"{type(e).__name__}: {e}")
            time.sleep(0.1)


ACTION = re.compile(r"cleave up: (flipped decode-\d|starting prefill-1) ")


def _prefill_in_rotation(up: Up) -> int:
    """Workers the router sends prefills to: healthy, in the prefill role as they report it."""
    seen = up.router_workers()
    return sum(1 for pool in ("prefill", "decode") for w in seen[pool]
               if w["healthy"] and w["role"] == "prefill")


def _time_to_second_prefill(tiny_model_dir: Path, tmp_path: Path, *extra: str
                            ) -> tuple[float, str, int]:
    """Seconds from cleave up's action (the flip done, or the new process started) to a
    second prefill worker in rotation; the log; and how many worker processes ran then.

    Timed from the action, not the load's start: when the autoscaler decides depends on its
    metrics window and on how busy the box is, which differ between the two runs."""
    up = Up(tiny_model_dir, tmp_path, *ARGS, *extra)
    stop, serving = threading.Event(), threading.Event()
    errors: list[str] = []
    loaders = [threading.Thread(target=_prompt_heavy, args=(up, stop, errors, i, serving))
               for i in range(2)]
    try:
        # The load is on from the first moment the router answers: an idle first decision
        # (decode 2 -> 1 by removal, with no prefill shortage to flip for) would race the test.
        for t in loaders:
            t.start()
        up.wait_up()
        serving.set()
        assert len(up.worker_pids()) == 3
        acted: list[float] = []

        def in_rotation() -> bool:
            if not acted and ACTION.search(up.log()):
                acted.append(time.monotonic())  # seen within a poll (0.2 s) of its line
            return bool(acted) and _prefill_in_rotation(up) == 2
        wait_for(in_rotation, 120, "a second prefill worker", up.log)
        took = time.monotonic() - acted[0]
        workers = len(up.worker_pids())
        time.sleep(2)  # requests keep flowing through the change
        stop.set()
        for t in loaders:
            t.join(timeout=60)
        assert not errors, errors[:3]
        log = up.log()
        up.ctrl_c_leaves_nothing()
        return took, log, workers
    finally:
        stop.set()
        up.kill()


def test_a_flip_adds_prefill_capacity_sooner_than_a_new_worker(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    flip_s, log, workers = _time_to_second_prefill(tiny_model_dir, tmp_path)
    assert re.search(r"flipped decode-\d \(decode worker\) to the prefill role", log), log[-3000:]
    assert "starting prefill-" not in log and workers == 3  # no process started or stopped
    start_s, log, _ = _time_to_second_prefill(tiny_model_dir, tmp_path, "--no-flips")
    assert "flipped" not in log and "starting prefill-1" in log, log[-3000:]
    print(f"\nsecond prefill worker in rotation after the action: flip {flip_s:.1f} s, "
          f"new process {start_s:.1f} s")
    assert flip_s < start_s
