"""``cleave worker`` and ``cleave router``: argument parsing and process wiring.

Their flags are the typed settings of ``cleave.common.settings`` (the operator writes pod
command lines from the same classes); ``--check`` parses everything, resolves the model and the
configuration, and exits without serving: what a deployment check runs for each container.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.common.settings import (
    API_KEY_ENV,
    INTERNAL_TOKEN_ENV,
    KV_SALT_ENV,
    REDIS_PASSWORD_ENV,
    RouterSettings,
    WorkerSettings,
)
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.gc_tuning import freeze_loaded_objects
from cleave.runtime.serving import http_server

if TYPE_CHECKING:
    from cleave.kv_store.redis_config import RedisStoreConfig


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")


def add_check_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="parse every flag, resolve the model source and the configuration, "
                        "print them and exit (0: the same command would start)")


def secret(path: str | None, env: str) -> str | None:
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(env) or None


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def internal_token(path: str | None, host: str) -> str | None:
    """The worker's internal token; a worker reachable beyond loopback must have one (its
    /internal/* API would otherwise serve any pod that reaches the port)."""
    token = secret(path, INTERNAL_TOKEN_ENV)
    if token is None and host not in LOOPBACK_HOSTS:
        raise ValueError(f"listening on {host} needs an internal token "
                         f"(--internal-token-file or {INTERNAL_TOKEN_ENV})")
    return token


def _error(what: str, e: Exception) -> int:
    print(f"cleave {what}: error: {e}", file=sys.stderr)
    return 2


def _checked(what: str, lines: list[str]) -> int:
    print(f"cleave {what}: configuration OK", *(f"  {line}" for line in lines), sep="\n")
    return 0


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="serve one engine (prefill, decode or both) over HTTP",
                       description="One engine behind the internal HTTP API the router calls.")
    WorkerSettings.add_arguments(p)
    add_check_argument(p)
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from cleave.kv_store.redis_config import RedisStoreConfig
    from cleave.runtime.cli import engine_config
    from cleave.runtime.models.loader import ModelLoadError, check_model

    settings = WorkerSettings.from_args(args)
    store = settings.store
    try:
        sock = _inherited(settings.listen_fd)
        if sock is not None:  # the socket says where it listens: the token rule below too
            host, port = _address(sock)
            settings = replace(settings, host=host, port=port)
        config = engine_config(settings.engine, secret(store.kv_salt_file, KV_SALT_ENV) or "")
        token = internal_token(settings.internal_token_file, settings.host)
        store_config = None
        if store.redis.redis_url:
            store_config = RedisStoreConfig.of(
                store.redis, secret(store.redis.redis_password_file, REDIS_PASSWORD_ENV),
                ttl_seconds=store.kv_ttl_seconds, timeout_seconds=store.store_timeout)
        if args.check:
            return _checked("worker", [
                f"role {settings.role} on {settings.host}:{settings.port} "
                f"(internal token: {'yes' if token else 'none, loopback only'})",
                f"model {check_model(config.model, config.revision)}",
                f"engine {replace(config, salt='<hidden>' if config.salt else '')}",
                f"store {store.redis.redis_url or 'none'} (namespace {store.namespace}, "
                f"ttl {store.kv_ttl_seconds} s, salted: {bool(config.salt)})"])
    except (ModelLoadError, OSError, ValueError) as e:
        return _error("worker", e)
    return _serve_worker(settings, config, store_config, token, sock)


def _inherited(fd: int | None) -> socket.socket | None:
    return None if fd is None else http_server.inherited_socket(fd)


def _address(sock: socket.socket) -> tuple[str, int]:
    """Host and port as an inherited socket has them (--host and --port only say)."""
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


def _serve_worker(settings: WorkerSettings, config: EngineConfig, store_config: object,
                  token: str | None, sock: socket.socket | None) -> int:
    from cleave.kv_store.codec import mac_key
    from cleave.kv_store.keys import KeySpace
    from cleave.kv_store.redis_config import RedisStoreConfig
    from cleave.kv_store.redis_store import RedisBlockStore
    from cleave.runtime.engine.async_engine import AsyncEngine
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.kv_connector import KVStoreConnector
    from cleave.runtime.serving.worker import Worker, serve

    setup_logging(f"{settings.role}:{settings.port}")
    engine = AsyncEngine(LLMEngine(config))
    freeze_loaded_objects()

    async def main() -> int:
        connector = None
        if isinstance(store_config, RedisStoreConfig):
            keys = KeySpace(settings.store.namespace, engine.engine.root_hash,
                            mac_key=mac_key(config.salt))
            store = RedisBlockStore(keys, store_config)
            connector = KVStoreConnector(engine, store, role=settings.role)
        elif settings.role == "prefill":
            logging.warning("a prefill worker without --redis-url cannot hand KV to decode "
                            "workers; they will recompute")
        worker = Worker(engine, settings.role, connector, token, settings.max_open_requests,
                        model_name=settings.served.names(config.model)[0])
        return await serve(worker, settings.host, settings.port, settings.grace_period,
                           settings.http, sock)

    return asyncio.run(main())


def add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible API in front of the workers",
                       description="Route OpenAI-compatible requests to prefill and decode "
                                   "workers.")
    RouterSettings.add_arguments(p)
    add_check_argument(p)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from cleave.runtime.models.loader import ModelLoadError, check_model

    s = RouterSettings.from_args(args)
    if not s.decode and not s.workers_file:
        print("cleave router: error: give at least one --decode worker URL (or --workers-file)",
              file=sys.stderr)
        return 2
    for flag, value in (("--hold-timeout", s.routing.hold_timeout),
                        ("--ttft-target", s.routing.ttft_target)):
        if value is not None and value < 0:
            print(f"cleave router: error: {flag} must be >= 0", file=sys.stderr)
            return 2
    try:
        sock = _inherited(s.listen_fd)
        if sock is not None:
            host, port = _address(sock)
            s = replace(s, host=host, port=port)
    except ValueError as e:
        return _error("router", e)
    if args.check:
        try:  # what _serve_router builds, but the tokenizer
            model = check_model(s.model, s.revision)
            secret(s.routing.api_key_file, API_KEY_ENV)
            secret(s.internal_token_file, INTERNAL_TOKEN_ENV)
            _router_store(s)
        except (ModelLoadError, OSError, ValueError) as e:
            return _error("router", e)
        return _checked("router", [f"listening on {s.host}:{s.port}", f"model {model}",
                                   f"served as {', '.join(s.served.names(s.model))}",
                                   f"prefill {list(s.prefill)}", f"decode {list(s.decode)}",
                                   f"routing {s.routing}"])
    return _serve_router(s, sock)


def _router_store(s: RouterSettings) -> RedisStoreConfig | None:
    """The router's view of the workers' store (None without one)."""
    from cleave.kv_store.redis_config import RedisStoreConfig

    if not s.redis.redis_url:
        return None
    return RedisStoreConfig.of(s.redis, secret(s.redis.redis_password_file, REDIS_PASSWORD_ENV))


def _serve_router(s: RouterSettings, sock: socket.socket | None) -> int:
    from cleave.runtime.models.loader import load_config, load_tokenizer, resolve_model
    from cleave.runtime.serving.router import Router, RouterConfig

    setup_logging(f"router:{s.port}")
    r = s.routing
    files = resolve_model(s.model, revision=s.revision)
    _, shape = load_config(files)
    first, *aliases = s.served.names(s.model)
    config = RouterConfig(
        model=first, aliases=tuple(aliases), prefill_urls=s.prefill, decode_urls=s.decode,
        model_source=s.model,
        disaggregate_min_tokens=r.disaggregate_min_tokens,
        kv_load_failure_policy=r.kv_load_failure_policy,
        request_timeout_seconds=r.request_timeout,
        max_concurrent_requests=r.max_concurrent_requests,
        api_key=secret(r.api_key_file, API_KEY_ENV), redis_store=_router_store(s),
        internal_token=secret(s.internal_token_file, INTERNAL_TOKEN_ENV),
        workers_file=s.workers_file, hold_timeout_seconds=r.hold_timeout or 0.0,
        ttft_target_seconds=r.ttft_target or None, tool_call_parser=r.tool_call_parser,
        show_cached_tokens=r.prompt_tokens_details == "show",
        max_prompt_scores=r.max_prompt_scores)
    max_len = min(s.max_model_len or shape.max_position_embeddings,
                  shape.max_position_embeddings)
    router = Router(config, load_tokenizer(files), max_len, shape.vocab_size)
    freeze_loaded_objects()
    logging.info("router listening on http://%s:%d", s.host, s.port)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request, which aborts it on the worker and frees its KV (streamed or not).
    http_server.run(router.app(), s.host, s.port, s.http, sock, handler_cancellation=True)
    return 0
