"""``cleave up``: the whole platform on one machine.

Starts redis-server (or uses ``--redis-url``), N prefill and M decode worker processes (one
torch thread each), and the router; merges their logs into one stream with the process name
on each line; prints the endpoint and examples once everything is ready; restarts a worker that
crashes (same port, as Kubernetes restarts a pod); on Ctrl-C or SIGTERM stops every process
(SIGTERM, then SIGKILL after a grace period) and removes its temp files. With ``--autoscale``
the worker processes come and go as the scaling policy decides (local_autoscale.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from cleave.kv_store.redis_config import split_password
from cleave.runtime.serving.autoscale_settings import (
    AutoscaleSettings,
    add_autoscale_arguments,
    describe_settings,
    settings_from_args,
)
from cleave.runtime.serving.commands import (
    add_router_policy_arguments,
    router_policy_flags,
    secret,
)
from cleave.runtime.serving.local_autoscale import LocalAutoscaler
from cleave.runtime.serving.local_processes import (
    Supervisor,
    engine_flags,
)

__all__ = ["add_up_parser", "run_up"]


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                  add_engine_arguments: object) -> None:
    p = sub.add_parser("up", help="run the whole platform on this machine",
                       description="Redis, prefill and decode workers, and the OpenAI-"
                                   "compatible router, as local processes.")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill worker processes (default 1; the starting count with "
                        "--autoscale). 0: no prefill role, decode workers serve whole requests "
                        "in the 'both' role")
    p.add_argument("--decode", type=int, default=1,
                   help="decode worker processes (default 1; the starting count with "
                        "--autoscale)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting a private redis-server")
    add_router_policy_arguments(p)
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long each process may take to answer /ready (default 600)")
    add_autoscale_arguments(p)
    add_engine_arguments(p)  # type: ignore[operator]
    p.set_defaults(func=run_up)


def _banner(endpoint: str, model: str) -> str:
    return f"""
Cleave is up: {endpoint}/v1  (model '{model}'; Ctrl-C stops everything)

  curl {endpoint}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{endpoint}/v1', api_key='-'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"
"""


def _password_to_env(url: str, env: dict[str, str]) -> str:
    """``ps`` shows every process's command line to every user: a password inside
    ``--redis-url`` reaches the workers and the router through their environment instead
    (where it wins over the URL; an ACL user's name stays in the URL)."""
    url, password = split_password(url)
    if password is not None:
        env["CLEAVE_REDIS_PASSWORD"] = password
    return url


def _router_command(args: argparse.Namespace, redis_url: str, sup: Supervisor,
                    autoscale: AutoscaleSettings | None) -> list[str]:
    cmd = ["router", "--model", args.model, "--host", args.host, "--port", str(args.port),
           "--redis-url", redis_url, *router_policy_flags(args)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if autoscale is not None:
        assert sup.workers_file is not None
        return [*cmd, "--workers-file", str(sup.workers_file),
                "--hold-timeout", str(autoscale.hold_timeout_s)]
    if args.hold_timeout:
        cmd += ["--hold-timeout", str(args.hold_timeout)]
    for p in sup.all():
        cmd += ["--prefill" if p.role == "prefill" else "--decode", p.url]
    return cmd


def run_up(args: argparse.Namespace) -> int:
    from cleave.kv_store.local_redis import start_local_redis
    from cleave.runtime.models.loader import resolve_model

    try:
        autoscale = settings_from_args(args)
    except ValueError as e:
        print(f"cleave up: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"cleave up: preparing model '{args.model}'", flush=True)
    resolve_model(args.model)  # convert once here, not in every worker at the same time
    redis = None
    redis_url = args.redis_url
    if redis_url is None:
        redis = start_local_redis()
        redis_url = redis.unix_url
        print(f"cleave up: redis-server on {redis.unixsocket}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    redis_url = _password_to_env(redis_url, env)
    tmp = Path(tempfile.mkdtemp(prefix="cleave-up-")) if autoscale else None
    sup = Supervisor([sys.executable, "-m", "cleave.runtime.cli"], env,
                     ["--redis-url", redis_url, *engine_flags(args)],
                     workers_file=tmp / "workers.json" if tmp else None)
    stopping = threading.Event()
    autoscaler: threading.Thread | None = None
    metrics_server: WSGIServer | None = None
    crashed = False

    def on_signal(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    try:
        if autoscale is None:
            counts = [("prefill", args.prefill), ("decode" if args.prefill else "both",
                                                   args.decode)]
        else:
            counts = [(autoscale.worker_roles[r], autoscale.initial[r])
                      for r in autoscale.worker_roles]
        for role, n in counts:
            for _ in range(n):
                sup.spawn_worker(role)
        sup.wait_ready(sup.all(), args.startup_timeout)
        sup.publish()
        router = sup.start_router(_router_command(args, redis_url, sup, autoscale),
                                  f"http://{args.host}:{args.port}")
        sup.wait_ready([router], args.startup_timeout)
        print(_banner(f"http://{args.host}:{args.port}", args.model), flush=True)
        if autoscale is not None:
            sup.say(describe_settings(autoscale))
            assert tmp is not None
            status_path = tmp / "autoscaler-status.json"
            metrics_server, _ = start_http_server(autoscale.metrics_port, addr=args.host)
            sup.say(f"autoscaler metrics on http://{args.host}:{metrics_server.server_port}"
                    f"/metrics; its last decisions in {status_path}")
            autoscaler = LocalAutoscaler(
                autoscale, sup, router.url, secret(args.api_key_file, "CLEAVE_API_KEY"),
                drain_timeout_s=args.request_timeout, status_path=status_path).start(stopping)
        while not stopping.is_set():
            reason = sup.watch(args.startup_timeout)
            if reason is not None:
                sup.say(f"{reason}; stopping")
                crashed = True
                break
            stopping.wait(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"cleave up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("cleave up: stopping", flush=True)
        stopping.set()
        if autoscaler is not None:
            autoscaler.join(timeout=10)  # no scale-up may start once the stop has begun
        if metrics_server is not None:
            metrics_server.shutdown()
        sup.stop_all()
        if redis is not None:
            redis.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if crashed else 0
