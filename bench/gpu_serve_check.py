"""bench/gpu.sh's serving step: wait for a ``cleave up`` router to be ready, send one completion
long enough to take the prefill->decode handoff, and check that text came back.

    python bench/gpu_serve_check.py http://127.0.0.1:8000 --timeout 270 --pid 1234

Exits 0 with one JSON line (latency, tokens), 1 with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog and runs into the forest."] * 6)


def _call(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def wait_ready(base: str, deadline: float, pid: int | None) -> None:
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise RuntimeError("cleave up exited before it was ready")
        try:
            _call(f"{base}/ready", timeout=5)
            return
        except (urllib.error.URLError, OSError, ValueError):
            time.sleep(1)
    raise RuntimeError("cleave up was not ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base")
    parser.add_argument("--timeout", type=float, default=270)
    parser.add_argument("--pid", type=int, default=None)
    args = parser.parse_args()
    try:
        wait_ready(args.base, time.monotonic() + args.timeout, args.pid)
        model = _call(f"{args.base}/v1/models")["data"][0]["id"]
        start = time.monotonic()
        reply = _call(f"{args.base}/v1/completions",
                      {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        seconds = time.monotonic() - start
    except (RuntimeError, urllib.error.URLError, OSError, KeyError, ValueError) as e:
        print(f"gpu_serve_check: {e}", file=sys.stderr)
        return 1
    text = reply["choices"][0]["text"]
    usage = reply["usage"]
    if not text or usage["completion_tokens"] < 1:
        print(f"gpu_serve_check: no text came back: {reply}", file=sys.stderr)
        return 1
    print(json.dumps({"serve_seconds": round(seconds, 3), "model": model,
                      "prompt_tokens": usage["prompt_tokens"],
                      "completion_tokens": usage["completion_tokens"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
