"""``cleave worker`` and ``cleave router``: argument parsing and process wiring."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from cleave.runtime.engine.config import DEFAULT_MODEL
from cleave.runtime.gc_tuning import freeze_loaded_objects


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                      add_engine_arguments: object) -> None:
    p = sub.add_parser("worker", help="serve one engine (prefill, decode or both) over HTTP",
                       description="One engine behind the internal HTTP API the router calls.")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--redis-url", default=None,
                   help="KV block store (redis://, rediss://, unix://); without it, decode "
                        "workers recompute every prompt")
    p.add_argument("--redis-password-file", default=None,
                   help="file holding the Redis password (or set CLEAVE_REDIS_PASSWORD)")
    p.add_argument("--namespace", default="default",
                   help="the service's KV namespace: services never share blocks")
    p.add_argument("--store-timeout", type=float, default=2.0, help="seconds per store call")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds to finish in-flight requests after SIGTERM")
    add_engine_arguments(p)  # type: ignore[operator]
    p.set_defaults(func=run_worker)


def secret(path: str | None, env: str) -> str | None:
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(env) or None


def run_worker(args: argparse.Namespace) -> int:
    from cleave.kv_store.keys import KeySpace
    from cleave.kv_store.redis_config import RedisStoreConfig
    from cleave.kv_store.redis_store import RedisBlockStore
    from cleave.runtime.cli import engine_config
    from cleave.runtime.engine.async_engine import AsyncEngine
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.kv_connector import KVStoreConnector
    from cleave.runtime.serving.worker import Worker, serve

    setup_logging(f"{args.role}:{args.port}")
    config = engine_config(args)
    engine = AsyncEngine(LLMEngine(config))
    freeze_loaded_objects()

    async def main() -> int:
        connector = None
        if args.redis_url:
            store = RedisBlockStore(
                KeySpace(args.namespace, engine.engine.root_hash),
                RedisStoreConfig(url=args.redis_url, timeout_seconds=args.store_timeout,
                                 password=secret(args.redis_password_file,
                                                  "CLEAVE_REDIS_PASSWORD")))
            connector = KVStoreConnector(engine, store, role=args.role)
        elif args.role == "prefill":
            logging.warning("a prefill worker without --redis-url cannot hand KV to decode "
                            "workers; they will recompute")
        return await serve(Worker(engine, args.role, connector), args.host, args.port,
                           args.grace_period)

    return asyncio.run(main())


def add_router_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The router's serving policy; `cleave router` and `cleave up` take the same flags."""
    g = p.add_argument_group("routing")
    g.add_argument("--disaggregate-min-tokens", type=int, default=64,
                   help="prompts (or their uncached part) shorter than this skip the separate "
                        "prefill")
    g.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"],
                   default="recompute",
                   help="when a prefilled prompt's KV is missing: recompute it, or fail (503)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument("--max-concurrent-requests", type=int, default=256,
                   help="beyond this, answer 429 with Retry-After")
    g.add_argument("--api-key-file", default=None,
                   help="require this Bearer key (or set CLEAVE_API_KEY)")
    g.add_argument("--hold-timeout", type=float, default=None, metavar="SECONDS",
                   help="scale from zero: hold a request this long for a first ready decode "
                        "worker instead of answering 503 at once (default 0; 60 with "
                        "`cleave up --autoscale`)")


def router_policy_flags(args: argparse.Namespace) -> list[str]:
    """The parsed routing flags, as arguments for a `cleave router` process."""
    flags = ["--disaggregate-min-tokens", str(args.disaggregate_min_tokens),
             "--kv-load-failure-policy", args.kv_load_failure_policy,
             "--request-timeout", str(args.request_timeout),
             "--max-concurrent-requests", str(args.max_concurrent_requests)]
    if args.api_key_file:
        flags += ["--api-key-file", args.api_key_file]
    return flags


def add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("router", help="the OpenAI-compatible API in front of the workers",
                       description="Route OpenAI-compatible requests to prefill and decode "
                                   "workers.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model whose tokenizer and chat template the router uses")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients ask for (default: --model)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill worker (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode or both-role worker (repeatable; at least one, unless "
                        "--workers-file is given)")
    p.add_argument("--workers-file", default=None, metavar="FILE",
                   help='JSON {"prefill": [URL...], "decode": [URL...]}, re-read every second: '
                        "workers that come and go (cleave up --autoscale writes it)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_router_policy_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the workers' context limit, if lower than the model's own")
    p.add_argument("--redis-url", default=None,
                   help="the workers' KV store: mostly-cached prompts then skip the separate "
                        "prefill")
    p.add_argument("--redis-password-file", default=None,
                   help="file holding the Redis password (or set CLEAVE_REDIS_PASSWORD)")
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from cleave.runtime.models.loader import load_config, load_tokenizer, resolve_model
    from cleave.runtime.serving.router import Router, RouterConfig

    setup_logging(f"router:{args.port}")
    if not args.decode and not args.workers_file:
        print("cleave router: error: give at least one --decode worker URL (or --workers-file)",
              file=sys.stderr)
        return 2
    if args.hold_timeout is not None and args.hold_timeout < 0:
        print("cleave router: error: --hold-timeout must be >= 0", file=sys.stderr)
        return 2
    files = resolve_model(args.model)
    _, shape = load_config(files)
    config = RouterConfig(
        model=args.served_model_name or args.model, prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode), disaggregate_min_tokens=args.disaggregate_min_tokens,
        kv_load_failure_policy=args.kv_load_failure_policy,
        request_timeout_seconds=args.request_timeout,
        max_concurrent_requests=args.max_concurrent_requests,
        api_key=secret(args.api_key_file, "CLEAVE_API_KEY"), redis_url=args.redis_url,
        redis_password=secret(args.redis_password_file, "CLEAVE_REDIS_PASSWORD"),
        workers_file=args.workers_file, hold_timeout_seconds=args.hold_timeout or 0.0)
    max_len = min(args.max_model_len or shape.max_position_embeddings,
                  shape.max_position_embeddings)
    router = Router(config, load_tokenizer(files), max_len, shape.vocab_size)
    freeze_loaded_objects()
    logging.info("router listening on http://%s:%d", args.host, args.port)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request, which aborts it on the worker and frees its KV (streamed or not).
    web.run_app(router.app(), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)
    return 0
