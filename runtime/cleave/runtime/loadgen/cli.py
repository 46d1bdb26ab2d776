"""``cleave bench``: load an OpenAI-compatible endpoint and report latency, throughput, goodput.

Exit status: 0 when every request succeeded, 1 when any failed (the report is written either
way), 2 when the benchmark could not run (bad option, unreadable prompts file, server not
reachable), 130 when interrupted (the partial report is written). The last line on stdout is
one JSON object: the figures under ``vllm bench serve``'s names, the server's KV-store figures
and the report's path.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the modules load when the command runs: `cleave --help` stays instant
    import aiohttp

    from cleave.runtime.loadgen.client import ClientConfig
    from cleave.runtime.loadgen.options import Settings
    from cleave.runtime.loadgen.record import RequestRecord
    from cleave.runtime.loadgen.runner import RunResult
    from cleave.runtime.loadgen.server_metrics import Counters

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_CANNOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint (Cleave or any other)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Send streamed requests to /v1/completions or /v1/chat/completions at a\n"
                    "request rate (open loop), a fixed concurrency (closed loop) or both (a\n"
                    "rate under a concurrency cap). Prompt lengths are in the served model's\n"
                    "tokens (counted with the server's /tokenize). Report TTFT, TPOT,\n"
                    "inter-token latency and end-to-end percentiles, throughput, goodput under\n"
                    "SLOs, errors by type and, against Cleave, the KV store's hit rate; write\n"
                    "report.json (with vllm bench serve's result keys) and PNG plots; print\n"
                    "one JSON line last. Durations are in seconds.",
        epilog="exit status: 0 every request succeeded, 1 some failed, 2 could not run, "
               "130 interrupted.\nSee docs/bench.md for what each figure means.")
    for add_group in (_target_options, _load_options, _workload_options, _report_options):
        add_group(p)
    p.set_defaults(func=bench)


def _target_options(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL, with or without /v1 (default %(default)s)")
    t.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: POST /v1/completions with a prompt; chat: POST "
                        "/v1/chat/completions, the prompt as one user message "
                        "(default %(default)s)")
    t.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="seconds for one whole request before it counts as a timeout "
                        "(default %(default)s)")


def _load_options(p: argparse.ArgumentParser) -> None:
    load = p.add_argument_group("load (default: --concurrency 1)")
    load.add_argument("--rate", "--request-rate", type=float, metavar="REQ_PER_S",
                      help="open loop: requests per second on average")
    load.add_argument("--concurrency", "--max-concurrency", type=int, metavar="N",
                      help="alone: closed loop, N requests kept in flight; with --rate: at "
                           "most N in flight, later arrivals wait for a free slot")
    load.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson",
                      help="with --rate: Poisson, or bursty gamma-distributed gaps")
    load.add_argument("--burstiness", type=float, default=None, metavar="SHAPE",
                      help="gamma shape of the gaps for --arrivals bursty; below 1 is burstier "
                           "(default 0.25; 1 would be Poisson)")
    load.add_argument("--num-requests", "--num-prompts", type=int, default=None, metavar="N",
                      help="measured requests to send (default 100, or unlimited with "
                           "--duration)")
    load.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="seconds to keep sending (with --num-requests: whichever ends first)")
    load.add_argument("--num-warmups", type=int, default=0, metavar="N",
                      help="warm-up requests sent first, with the workload's lengths and "
                           "prompts of their own, and left out of every figure (default 0)")
    load.add_argument("--seed", type=int, default=0, help="for arrivals and prompts (default 0)")


def _workload_options(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (lengths in tokens: N, fixed:N or uniform:A-B)")
    w.add_argument("--prompt-len", default=None, metavar="LEN",
                   help="synthetic prompt length in the served model's tokens (default 128)")
    w.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="N distinct prompt prefixes, shared round-robin by the requests, each "
                        "followed by a suffix of its own (vLLM's prefix_repetition)")
    w.add_argument("--prefix-len", type=int, default=None, metavar="TOKENS",
                   help="with --shared-prefix: tokens of each prefix (default 256)")
    w.add_argument("--suffix-len", default=None, metavar="LEN",
                   help="with --shared-prefix: tokens after the prefix (default 128)")
    w.add_argument("--output-len", default="64", metavar="LEN",
                   help="max_tokens per request (default 64)")
    w.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help='prompts file, one {"prompt": ...} or {"messages": [...]} per line, '
                        'optionally with "max_tokens"')
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos: true (for servers that refuse it; outputs may "
                        "then end before --output-len)")
    w.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: not sent, the server's default)")


def _report_options(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("report")
    r.add_argument("--ttft-slo", default=None, metavar="SECONDS",
                   help="goodput objective: time to first token at most SECONDS (0.5, or "
                        "500ms)")
    r.add_argument("--tpot-slo", default=None, metavar="SECONDS",
                   help="goodput objective: time per output token at most SECONDS (0.05, or "
                        "50ms)")
    r.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                   help="do not read the KV store's counters from the workers Cleave's "
                        "router lists")
    r.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where report.json and the PNGs go (default ./cleave-bench-DATE-TIME)")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")


def bench(args: argparse.Namespace) -> int:
    from cleave.runtime.loadgen.client import SetupError
    from cleave.runtime.loadgen.options import settings_from_args

    try:
        settings = settings_from_args(args)
    except ValueError as e:  # PromptsFileError is one
        print(f"cleave bench: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    for warning in settings.warnings:
        print(f"cleave bench: warning: {warning}", file=sys.stderr)
    try:
        return asyncio.run(_bench(args, settings))
    except SetupError as e:
        print(f"cleave bench: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:  # before the run's own handler is installed: nothing to report
        return EXIT_INTERRUPTED


async def _token_vocab(session: aiohttp.ClientSession, cfg: ClientConfig, s: Settings
                       ) -> Settings:
    """Synthetic prompts: sized in the server's tokens (tokens.py); a prompts file: as is."""
    from cleave.runtime.loadgen import tokens
    from cleave.runtime.loadgen.workload import WORDS

    if s.workload.prompts:
        return s
    count = tokens.server_counter(session, tokens.server_root(cfg.api_root), cfg.model,
                                  cfg.api_key)
    workload = replace(s.workload, vocab=await tokens.one_token_words(count, WORDS))
    longest = workload.longest_prompt()
    await tokens.check_length(count, longest, len(longest.split()))
    return replace(s, workload=workload)


async def _warm_up(session: aiohttp.ClientSession, cfg: ClientConfig, s: Settings
                   ) -> tuple[RequestRecord, ...]:
    from cleave.runtime.loadgen.arrivals import max_concurrency
    from cleave.runtime.loadgen.progress import Progress
    from cleave.runtime.loadgen.runner import warm_up

    if not s.warmups:
        return ()
    began = time.perf_counter()
    quiet = Progress(s.warmups, None, stream=io.StringIO(), tty=False)
    records = await warm_up(session, cfg, s.workload, s.warmups,
                            max_concurrency(s.schedule) or s.warmups, quiet)
    ok = sum(r.ok for r in records)
    print(f"cleave bench: warm-up: {len(records)} requests, {ok} ok, {len(records) - ok} "
          f"failed in {time.perf_counter() - began:.1f} s (not in the figures)", file=sys.stderr)
    return records


async def _counters(session: aiohttp.ClientSession, urls: list[str] | None
                    ) -> Counters | None:
    import aiohttp

    from cleave.runtime.loadgen.server_metrics import scrape

    if not urls:
        return None
    try:
        return await scrape(session, urls)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        print(f"cleave bench: warning: cannot read the workers' /metrics ({type(e).__name__}: "
              f"{e}); no KV-store figures", file=sys.stderr)
        return None


async def _bench(args: argparse.Namespace, s: Settings) -> int:
    import aiohttp

    from cleave.runtime.loadgen import runner, server_metrics, tokens
    from cleave.runtime.loadgen.arrivals import describe
    from cleave.runtime.loadgen.client import ClientConfig, SetupError, api_root, list_models
    from cleave.runtime.loadgen.progress import Progress

    root = api_root(args.url)
    connector = aiohttp.TCPConnector(limit=0)  # the schedule, not the pool, limits concurrency
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = args.model
        if model is None:
            models = await list_models(session, root, args.api_key)
            if not models:
                raise SetupError(f"GET {root}/models lists no model; pass --model")
            model = models[0]
        cfg = ClientConfig(root, model, args.endpoint == "chat", args.timeout, args.api_key,
                           args.ignore_eos, args.temperature)
        s = await _token_vocab(session, cfg, s)
        print(f"cleave bench: {describe(s.schedule)} to {cfg.endpoint_url} (model {model}); "
              f"{s.workload.describe()}", file=sys.stderr)
        warmups = await _warm_up(session, cfg, s)
        workers = (await server_metrics.worker_urls(session, tokens.server_root(root),
                                                    args.api_key)
                   if args.server_metrics else None)
        urls = [tokens.server_root(root), *workers] if workers else None  # router + workers
        before = await _counters(session, urls)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        started = time.time()
        try:
            result = await runner.run(session, cfg, s.workload, s.schedule, s.limits,
                                      s.workload.seed, Progress(s.limits.num_requests,
                                                                s.limits.duration), stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        after = await _counters(session, urls) if before is not None else None
    server = None
    if before is not None and after is not None and workers:
        prompt_tokens = sum(r.prompt_tokens or 0 for r in result.records if r.ok)
        server = server_metrics.figures(before, after, prompt_tokens, len(workers))
    return _finish(args, s, cfg, result, started, warmups, server)


def _config(args: argparse.Namespace, s: Settings, cfg: ClientConfig,
            started: float) -> dict[str, Any]:
    from cleave.runtime.loadgen.arrivals import OpenLoop, describe, max_concurrency

    sched, shared = s.schedule, s.workload.shared
    return {
        "url": args.url, "endpoint_url": cfg.endpoint_url, "model": cfg.model,
        "endpoint": args.endpoint, "load": describe(s.schedule),
        "workload": s.workload.describe(),
        "rate": sched.rate if isinstance(sched, OpenLoop) else None,
        "gamma_shape": sched.shape if isinstance(sched, OpenLoop) else None,
        "concurrency": max_concurrency(sched),
        "num_requests": s.limits.num_requests, "duration_s": s.limits.duration,
        "num_warmups": s.warmups,
        "prompt_len": None if s.workload.prompts else s.workload.prompt_len.describe(),
        "shared_prefix": None if shared is None else {
            "num_prefixes": shared.num_prefixes, "prefix_len": shared.prefix_len},
        "output_len": s.workload.output_len.describe(),
        "prompts_file": str(args.prompts) if args.prompts else None,
        "timeout_s": args.timeout, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }


def _finish(args: argparse.Namespace, s: Settings, cfg: ClientConfig, result: RunResult,
            started: float, warmups: tuple[RequestRecord, ...],
            server: dict[str, Any] | None) -> int:
    from cleave.runtime.loadgen.report import build_report
    from cleave.runtime.loadgen.summary import format_summary
    from cleave.runtime.loadgen.vllm_result import vllm_result

    report = build_report(result.records, result.duration, s.slo,
                          _config(args, s, cfg, started), result.interrupted)
    report["warmup"] = {"sent": len(warmups), "completed": sum(r.ok for r in warmups),
                        "failed": sum(not r.ok for r in warmups)}
    report["server"] = server
    vllm = vllm_result(report)
    report.update(vllm)  # top level: tools that read vLLM's result files read this one
    s.out.mkdir(parents=True, exist_ok=True)
    path = s.out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    if args.plots and result.records:
        from cleave.runtime.loadgen.plots import write_plots

        for png in write_plots(result.records, report, s.out):
            print(f"plot: {png}")
    print(f"report: {path}")
    print(json.dumps({**vllm, "num_warmups": len(warmups), "server": server,
                      "report": str(path)}))
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED_REQUESTS if report["requests"]["failed"] else EXIT_OK
