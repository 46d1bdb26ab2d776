"""``cleave up``: the whole platform as local processes, and a clean stop."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from cleave.runtime.serving.up import said_port


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        tree.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def test_up_serves_and_stops_cleanly_on_ctrl_c(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cleave.common.cli", "up", "--model", str(tiny_model_dir),
         "--dtype", "float32", "--kv-cache-memory", "8MiB", "--port", "0",
         "--disaggregate-min-tokens", "16", "--served-model-name", "up-v2", "up"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while (port := said_port(log.read_text())) is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        children = _children(proc.pid)
        assert len(children) >= 4  # redis-server, two workers, the router
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0)
        # Both served names reach the router; replies carry the first (vLLM's rule).
        assert [m.id for m in client.models.list().data] == ["up-v2", "up"]
        reply = client.completions.create(model="up", prompt="hello " * 20, max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.model == "up-v2"
        text = log.read_text()
        assert "model 'up-v2'" in text  # the banner's name is one a client may send
        # One merged log stream, each line naming its process.
        assert re.search(r"\[ *prefill-0\] ", text) and re.search(r"\[ *decode-0\] ", text)
        assert "curl " in text and "OpenAI(" in text
        sock_dir = re.search(r"redis-server on (\S+)/redis.sock", text)
        assert sock_dir
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        alive = [c for c in children if Path(f"/proc/{c}").exists()
                 and "zombie" not in Path(f"/proc/{c}/status").read_text().lower()]
        assert not alive, f"orphans left: {alive}"
        assert not Path(sock_dir.group(1)).exists(), "temp files removed"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            raise AssertionError("the router still answers")
        except OSError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_taken_port_is_said_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "cleave.common.cli", "up", "--model",
                               str(tmp_path / "no-model"), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "preparing model" not in done.stdout
