"""``cleave up``: the whole platform on one machine.

Starts redis-server (or uses ``--redis-url``), N prefill and M decode worker processes (one
torch thread each), and the router; merges their logs into one stream with the process name
on each line; prints the endpoint and examples once everything is ready; restarts a worker that
crashes (same port, as Kubernetes restarts a pod); on Ctrl-C or SIGTERM stops every process
(SIGTERM, then SIGKILL after a grace period) and removes its temp files. With ``--autoscale``
the worker processes come and go as the scaling policy decides (local_autoscale.py). On a
machine with several GPUs each worker process sees one of them (gpus.py).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from cleave.autoscaling.metrics_server import start_metrics_server
from cleave.common.settings import (
    INTERNAL_TOKEN_ENV,
    EngineSettings,
    HttpSettings,
    RedisSettings,
    RouterSettings,
    RoutingSettings,
    ServedSettings,
    StoreSettings,
    WorkerSettings,
)
from cleave.kv_store.redis_config import split_password
from cleave.runtime.serving import http_server
from cleave.runtime.serving.autoscale_settings import (
    AutoscaleSettings,
    add_autoscale_arguments,
    describe_settings,
    settings_from_args,
)
from cleave.runtime.serving.commands import secret
from cleave.runtime.serving.gpus import VISIBLE, gpus_for_workers
from cleave.runtime.serving.local_autoscale import LocalAutoscaler
from cleave.runtime.serving.local_processes import Supervisor

if TYPE_CHECKING:
    from cleave.kv_store.local_redis import LocalRedis

__all__ = ["add_up_parser", "run_up", "said_port"]


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up",
                       help="run the whole platform on this machine (redis, workers, router)",
                       description="Redis, prefill and decode workers, and the OpenAI-"
                                   "compatible router, as local processes; with several "
                                   "GPUs, each worker gets its own (CUDA_VISIBLE_DEVICES).")
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill worker processes (default 1; the starting count with "
                        "--autoscale). 0: no prefill role, decode workers serve whole requests "
                        "in the 'both' role")
    p.add_argument("--decode", type=int, default=1,
                   help="decode worker processes (default 1; the starting count with "
                        "--autoscale)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000,
                   help="the router's port (default 8000; 0: any free one, said in the "
                        "'Cleave is up' line)")
    RedisSettings.add_arguments(p)  # without --redis-url: a private redis-server
    RoutingSettings.add_arguments(p)
    HttpSettings.add_arguments(p)  # the router's, the workers' and the metrics server's
    ServedSettings.add_arguments(p)
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long each process may take to answer /ready (default 600)")
    add_autoscale_arguments(p)
    EngineSettings.add_arguments(p)
    p.set_defaults(func=run_up)


UP_LINE = "Cleave is up: {endpoint}/v1"
_SAID = re.compile("^" + re.escape(UP_LINE).replace(re.escape("{endpoint}"),
                                                    r"http://\S+:(\d+)"), re.MULTILINE)


def said_port(log: str) -> int | None:
    """The router's port in a ``cleave up`` log's "Cleave is up" line; None until it is up.
    How a script (or a test) that started it with ``--port 0`` finds it."""
    found = _SAID.search(log)
    return None if found is None else int(found[1])


def _banner(endpoint: str, model: str) -> str:
    return f"""
{UP_LINE.format(endpoint=endpoint)}  (model '{model}'; Ctrl-C stops everything)

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


def _router_command(args: argparse.Namespace, store: RedisSettings, sup: Supervisor,
                    autoscale: AutoscaleSettings | None, sock: socket.socket) -> list[str]:
    routing = RoutingSettings.from_args(args)
    settings = RouterSettings(model=args.model, revision=args.revision,
                              served=ServedSettings.from_args(args), host=args.host,
                              port=sock.getsockname()[1], redis=store,
                              max_model_len=args.max_model_len,
                              routing=routing, http=HttpSettings.from_args(args))
    if autoscale is not None:
        assert sup.workers_file is not None
        settings = replace(settings, workers_file=str(sup.workers_file),
                           routing=replace(routing, hold_timeout=autoscale.hold_timeout_s))
    else:
        workers = sup.all()
        settings = replace(settings,
                           prefill=tuple(p.url for p in workers if p.role == "prefill"),
                           decode=tuple(p.url for p in workers if p.role != "prefill"))
    return ["router", *settings.to_args()]


def _error(message: object) -> None:
    print(f"cleave up: error: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Start:
    autoscale: AutoscaleSettings | None
    connection: RedisSettings
    router_socket: socket.socket
    endpoint: str  # with the port the router's socket got (--port 0)


def _prepare(args: argparse.Namespace) -> _Start | None:
    """What can refuse the start before any process runs: the flags, the router's port (first:
    a taken port is said at once), the model (converted or downloaded once, here, not in every
    worker at the same time). None: refused, and said so."""
    from cleave.runtime.models.loader import ModelLoadError, resolve_model

    try:
        autoscale = settings_from_args(args)
        connection = RedisSettings.from_args(args)
        if connection.redis_url is None and connection != RedisSettings():
            raise ValueError("--redis-password-file and --redis-tls-* apply to a --redis-url, "
                             "not to the private redis-server")
    except ValueError as e:
        _error(e)
        return None
    try:
        sock = http_server.bound_socket(args.host, args.port, listen=True)
    except (OSError, ValueError) as e:
        _error(f"cannot listen on {args.host}:{args.port}: "
               f"{getattr(e, 'strerror', None) or e}")
        return None
    print(f"cleave up: preparing model '{args.model}'", flush=True)
    try:
        resolve_model(args.model, revision=args.revision)
    except ModelLoadError as e:
        sock.close()
        _error(e)
        return None
    return _Start(autoscale, connection, sock, f"http://{args.host}:{sock.getsockname()[1]}")


def _private_redis() -> LocalRedis | None:
    from cleave.kv_store.local_redis import start_local_redis

    try:
        redis = start_local_redis()
    except RuntimeError as e:  # not installed, or it did not start: its log says why
        _error(e)
        return None
    print(f"cleave up: redis-server on {redis.unixsocket}", flush=True)
    return redis


def run_up(args: argparse.Namespace) -> int:
    start = _prepare(args)
    if start is None:
        return 2
    autoscale, router_socket = start.autoscale, start.router_socket
    redis, redis_url = None, args.redis_url
    if redis_url is None:
        redis = _private_redis()
        if redis is None:
            router_socket.close()
            return 2
        redis_url = redis.unix_url
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    store = replace(start.connection, redis_url=_password_to_env(redis_url, env))
    # The key of the workers' internal API: the caller's own (CLEAVE_INTERNAL_TOKEN, to reach
    # the workers directly), else a fresh one, in memory and the children's environment only:
    # another local user who finds a worker's port cannot call it past the router.
    env[INTERNAL_TOKEN_ENV] = env.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)
    tmp = Path(tempfile.mkdtemp(prefix="cleave-up-")) if autoscale else None
    worker = WorkerSettings(served=ServedSettings.from_args(args),
                            store=StoreSettings(redis=store),
                            engine=EngineSettings.from_args(args),
                            http=HttpSettings.from_args(args))
    gpus = gpus_for_workers(worker.engine.device, env,
                            ranks=worker.engine.tensor_parallel_size)
    if gpus:
        print(f"cleave up: one GPU per worker, round-robin over {VISIBLE}={','.join(gpus)}",
              flush=True)
    sup = Supervisor([sys.executable, "-m", "cleave.common.cli"], env, worker,
                     workers_file=tmp / "workers.json" if tmp else None, gpus=gpus)
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
        router = sup.start_router(_router_command(args, store, sup, autoscale, router_socket),
                                  router_socket)
        sup.wait_ready([router], args.startup_timeout)
        print(_banner(start.endpoint, worker.served.names(args.model)[0]), flush=True)
        if autoscale is not None:
            sup.say(describe_settings(autoscale))
            assert tmp is not None
            status_path = tmp / "autoscaler-status.json"
            metrics_server, _ = start_metrics_server(
                autoscale.metrics_port, args.host, worker.http.header_read_timeout)
            sup.say(f"autoscaler metrics on http://{args.host}:{metrics_server.server_port}"
                    f"/metrics; its last decisions in {status_path}")
            autoscaler = LocalAutoscaler(
                autoscale, sup, router.url, secret(args.api_key_file, "CLEAVE_API_KEY"),
                drain_timeout_s=args.request_timeout, status_path=status_path,
                internal_token=env[INTERNAL_TOKEN_ENV]).start(stopping)
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
        _error(e)
        return 1
    finally:
        print("cleave up: stopping", flush=True)
        router_socket.close()  # not started: a client waiting on it is refused, not left hanging
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
