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

ARGS = ("--autoscale", "--autoscale-interval", "0.5", "--metrics-window", "2",
        "--prefill", "1", "--decode", "2", "--prefill-max", "2", "--decode-min", "1",
        "--decode-max", "2", "--ttft-slo", "0.00001", "--tpot-slo", "10", "--kv-watermark", "0",
        "--scale-down-window", "0")


def _prompt_heavy(up: Up, stop: threading.Event, errors: list[str], offset: int,
                  serving: threading.Event) -> None:
    """Long prompts, four output tokens (the decode side reports TPOT), each prompt new (nothing
    cached): prefill work."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="-", max_retries=0, timeout=60)
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


def _prefill_in_rotation(up: Up) -> int:
    """Workers the router sends prefills to: healthy, in the prefill role as they report it."""
    seen = up.router_workers()
    return sum(1 for pool in ("prefill", "decode") for w in seen[pool]
               if w["healthy"] and w["role"] == "prefill")


def _time_to_second_prefill(tiny_model_dir: Path, tmp_path: Path, *extra: str
                            ) -> tuple[float, str, int]:
    """Seconds from the load's start to a second prefill worker in rotation; the log; and how
    many worker processes ran then."""
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
        started = time.monotonic()
        assert len(up.worker_pids()) == 3
        wait_for(lambda: _prefill_in_rotation(up) == 2, 120, "a second prefill worker", up.log)
        took = time.monotonic() - started
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
    print(f"\nsecond prefill worker in rotation: flip {flip_s:.1f} s, "
          f"new process {start_s:.1f} s")
    assert flip_s < start_s
