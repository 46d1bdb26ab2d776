"""``cleave up``: the whole platform on one machine.

Starts redis-server (or uses ``--redis-url``), N prefill and M decode worker processes (one
torch thread each), and the router; merges their logs into one stream with the process name
on each line; prints the endpoint and examples once everything is ready; on Ctrl-C or SIGTERM
stops every process (SIGTERM, then SIGKILL after a grace period) and removes its temp files.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from cleave.runtime.serving.commands import add_router_policy_arguments, router_policy_flags


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                  add_engine_arguments: object) -> None:
    p = sub.add_parser("up", help="run the whole platform on this machine",
                       description="Redis, prefill and decode workers, and the OpenAI-"
                                   "compatible router, as local processes.")
    p.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting a private redis-server")
    add_router_policy_arguments(p)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_engine_arguments(p)  # type: ignore[operator]
    p.set_defaults(func=run_up)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Process:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    pump: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.pump = threading.Thread(target=self._relay, daemon=True)
        self.pump.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            print(f"[{self.name:>10}] {line}", flush=True)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-batched-tokens", str(args.max_batched_tokens), "--threads", str(args.threads)]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", args.kv_cache_memory]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    return flags


def _wait_ready(processes: list[_Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with code {p.proc.returncode}")
            try:
                with urllib.request.urlopen(p.url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        pending.remove(p)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s: "
                               f"{', '.join(p.name for p in pending)}")
        time.sleep(0.2)


def _stop(processes: list[_Process], grace: float = 40.0) -> None:
    """SIGTERM all, then SIGKILL what outlives the workers' own drain period."""
    for p in processes:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


def run_up(args: argparse.Namespace) -> int:
    from cleave.kv_store.local_redis import start_local_redis
    from cleave.runtime.models.loader import resolve_model

    print(f"cleave up: preparing model '{args.model}'", flush=True)
    resolve_model(args.model)  # convert once here, not in every worker at the same time
    redis = None
    redis_url = args.redis_url
    if redis_url is None:
        redis = start_local_redis()
        redis_url = redis.unix_url
        print(f"cleave up: redis-server on {redis.unixsocket}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-m", "cleave.runtime.cli"]
    processes: list[_Process] = []
    stopping = threading.Event()
    crashed = False

    def on_signal(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    try:
        workers = [("prefill", i) for i in range(args.prefill)] + \
                  [("decode" if args.prefill else "both", i) for i in range(args.decode)]
        for role, i in workers:
            port = _free_port()
            proc = subprocess.Popen(
                [*cli, "worker", "--role", role, "--port", str(port), "--redis-url", redis_url,
                 *_engine_flags(args)], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
            processes.append(_Process(f"{role}-{i}", proc, f"http://127.0.0.1:{port}"))
        _wait_ready(processes, args.startup_timeout)
        router_cmd = [*cli, "router", "--model", args.model, "--host", args.host,
                      "--port", str(args.port), "--redis-url", redis_url,
                      *router_policy_flags(args)]
        if args.max_model_len:
            router_cmd += ["--max-model-len", str(args.max_model_len)]
        for p in processes:
            router_cmd += ["--prefill" if p.name.startswith("prefill") else "--decode", p.url]
        router = subprocess.Popen(router_cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        processes.append(_Process("router", router, f"http://{args.host}:{args.port}"))
        _wait_ready(processes[-1:], args.startup_timeout)
        endpoint = f"http://{args.host}:{args.port}"
        print(f"""
Cleave is up: {endpoint}/v1  (model '{args.model}'; Ctrl-C stops everything)

  curl {endpoint}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{args.model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{endpoint}/v1', api_key='-'); \\
print(c.chat.completions.create(model='{args.model}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"
""", flush=True)
        while not stopping.is_set():
            for p in processes:
                if p.proc.poll() is not None:
                    print(f"cleave up: {p.name} exited with code {p.proc.returncode}; "
                          "stopping", flush=True)
                    crashed = True
                    stopping.set()
            stopping.wait(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"cleave up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("cleave up: stopping", flush=True)
        _stop(processes)
        if redis is not None:
            redis.stop()
    return 1 if crashed else 0
