"""The default ``cleave up`` (one prefill, one decode worker) loses its only decode worker under
streaming load: no request fails. The prefill worker finishes the streams the decode worker
dropped and serves whole requests until ``cleave up`` has restarted it; then decode serves again.
(Before convertible workers every request in those seconds got a 503.)
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import openai
from local_autoscale_support import Up, descendants, wait_for

CLIENTS = 6


def _stream_forever(up: Up, stop: threading.Event, done: list[int], errors: list[str],
                    n: int) -> None:
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="-", max_retries=0, timeout=60)
    i = 0
    while not stop.is_set():
        i += 1
        try:
            chunks = list(client.completions.create(
                model=up.model, prompt=f"{n} {i} " + "the quick brown fox " * 6, max_tokens=24,
                temperature=0, stream=True, extra_body={"ignore_eos": True}))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            if finish != "length" or not text:
                errors.append(f"stream ended {finish!r} with {len(text)} characters")
            done.append(n)
        except openai.APIError as e:
            errors.append(f"{type(e).__name__}: {e}")


def _decode_pid(up: Up) -> int:
    [pid] = [p for p, cmd in descendants(up.proc.pid).items()
             if " worker " in cmd and "--role=decode" in cmd]
    return pid


def test_killing_the_only_decode_worker_fails_no_request(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    up = Up(tiny_model_dir, tmp_path)  # the default split: one prefill, one decode worker
    stop = threading.Event()
    done: list[int] = []
    errors: list[str] = []
    clients = [threading.Thread(target=_stream_forever, args=(up, stop, done, errors, n))
               for n in range(CLIENTS)]
    try:
        up.wait_up()
        victim = _decode_pid(up)
        for t in clients:
            t.start()
        wait_for(lambda: len(done) >= CLIENTS, 60, "streams flowing", up.log)
        os.kill(victim, signal.SIGKILL)
        killed_at = len(done)
        # Served meanwhile: streams go on while the decode worker is gone and restarting.
        wait_for(lambda: up.healthy("decode") == 0, 30, "the router saw it go", up.log)
        wait_for(lambda: up.healthy("decode") == 1 and _decode_pid(up) != victim, 120,
                 "the decode worker restarted and back in rotation", up.log)
        served_without_decode = len(done) - killed_at
        back_at = len(done)
        wait_for(lambda: len(done) >= back_at + 2 * CLIENTS, 60, "streams after", up.log)
        stop.set()
        for t in clients:
            t.join(timeout=60)
        assert not errors, errors[:5]
        assert served_without_decode >= 1  # the prefill worker served while decode was gone
        assert "restarting it" in up.log()
        up.ctrl_c_leaves_nothing()
    finally:
        stop.set()
        up.kill()
