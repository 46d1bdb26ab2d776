"""``cleave bench``: load an OpenAI-compatible endpoint and report latency, throughput, goodput.

Exit status: 0 when every request succeeded, 1 when any failed (the report is written either
way), 2 when the benchmark could not run (bad option, unreadable prompts file, server not
reachable), 130 when interrupted (the partial report is written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the modules load when the command runs: `cleave --help` stays instant
    from cleave.runtime.loadgen.arrivals import Schedule
    from cleave.runtime.loadgen.client import ClientConfig
    from cleave.runtime.loadgen.report import Slo
    from cleave.runtime.loadgen.runner import Limits, RunResult
    from cleave.runtime.loadgen.workload import Workload

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_CANNOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_BURSTINESS = 0.25
DEFAULT_NUM_REQUESTS = 100


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint (Cleave or any other)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Send streamed requests to /v1/completions or /v1/chat/completions at a\n"
                    "request rate (open loop) or a fixed concurrency (closed loop). Report TTFT,\n"
                    "TPOT, inter-token latency and end-to-end percentiles, throughput, goodput\n"
                    "under SLOs and errors by type; write report.json and PNG plots.",
        epilog="exit status: 0 every request succeeded, 1 some failed, 2 could not run, "
               "130 interrupted.\nSee docs/bench.md for what each figure means.")
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
    load = p.add_argument_group("load (default: --concurrency 1)")
    how = load.add_mutually_exclusive_group()
    how.add_argument("--rate", type=float, metavar="REQ_PER_S",
                     help="open loop: requests per second on average")
    how.add_argument("--concurrency", type=int, metavar="N",
                     help="closed loop: requests kept in flight")
    load.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson",
                      help="with --rate: Poisson, or bursty gamma-distributed gaps")
    load.add_argument("--burstiness", type=float, default=None, metavar="SHAPE",
                      help="gamma shape of the gaps for --arrivals bursty; below 1 is burstier "
                           f"(default {DEFAULT_BURSTINESS}; 1 would be Poisson)")
    load.add_argument("--num-requests", type=int, default=None, metavar="N",
                      help=f"requests to send (default {DEFAULT_NUM_REQUESTS}, "
                           "or unlimited with --duration)")
    load.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="seconds to keep sending (with --num-requests: whichever ends first)")
    load.add_argument("--seed", type=int, default=0, help="for arrivals and prompts (default 0)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-len", default=None, metavar="LEN",
                   help="synthetic prompt length in words: N, fixed:N or uniform:A-B "
                        "(default 128)")
    w.add_argument("--output-len", default="64", metavar="LEN",
                   help="max_tokens per request: N, fixed:N or uniform:A-B (default 64)")
    w.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help='prompts file, one {"prompt": ...} or {"messages": [...]} per line, '
                        'optionally with "max_tokens"')
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos: true (for servers that refuse it; outputs may "
                        "then end before --output-len)")
    w.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: not sent, the server's default)")
    r = p.add_argument_group("report")
    r.add_argument("--ttft-slo", type=float, default=None, metavar="MS",
                   help="goodput objective: time to first token at most MS milliseconds")
    r.add_argument("--tpot-slo", type=float, default=None, metavar="MS",
                   help="goodput objective: time per output token at most MS milliseconds")
    r.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where report.json and the PNGs go (default ./cleave-bench-DATE-TIME)")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    p.set_defaults(func=bench)


@dataclass(frozen=True)
class Settings:
    schedule: Schedule
    limits: Limits
    workload: Workload
    slo: Slo
    out: Path


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be positive, not {value:g}")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Every option checked before anything is sent; raises ValueError with a clear message."""
    from cleave.runtime.loadgen.arrivals import ClosedLoop, OpenLoop
    from cleave.runtime.loadgen.report import Slo
    from cleave.runtime.loadgen.runner import Limits
    from cleave.runtime.loadgen.workload import LengthDist, Workload, load_prompts, parse_length

    for name in ("timeout", "ttft_slo", "tpot_slo"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.rate is None and (args.arrivals != "poisson" or args.burstiness is not None):
        raise ValueError("--arrivals and --burstiness shape the gaps of --rate; "
                         "they do not apply to --concurrency")
    if args.burstiness is not None and args.arrivals != "bursty":
        raise ValueError("--burstiness needs --arrivals bursty")
    if args.rate is not None:
        shape = (args.burstiness or DEFAULT_BURSTINESS) if args.arrivals == "bursty" else 1.0
        schedule: OpenLoop | ClosedLoop = OpenLoop(args.rate, shape)
    else:
        schedule = ClosedLoop(args.concurrency if args.concurrency is not None else 1)
    num = args.num_requests
    if num is None and args.duration is None:
        num = DEFAULT_NUM_REQUESTS
    limits = Limits(num, args.duration)
    if args.prompts is not None and args.prompt_len is not None:
        raise ValueError("--prompt-len is for synthetic prompts; a --prompts file sets its own")
    prompts = load_prompts(args.prompts, args.endpoint == "chat") if args.prompts else ()
    prompt_len = parse_length(args.prompt_len) if args.prompt_len else LengthDist(128, 128)
    workload = Workload(parse_length(args.output_len), prompt_len, prompts, args.seed)
    slo = Slo(None if args.ttft_slo is None else args.ttft_slo / 1000.0,
              None if args.tpot_slo is None else args.tpot_slo / 1000.0)
    out = args.out or Path(time.strftime("cleave-bench-%Y%m%d-%H%M%S"))
    return Settings(schedule, limits, workload, slo, out)


def bench(args: argparse.Namespace) -> int:
    from cleave.runtime.loadgen.client import SetupError

    try:
        settings = settings_from_args(args)
    except ValueError as e:  # PromptsFileError is one
        print(f"cleave bench: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        return asyncio.run(_bench(args, settings))
    except SetupError as e:
        print(f"cleave bench: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:  # before the run's own handler is installed: nothing to report
        return EXIT_INTERRUPTED


async def _bench(args: argparse.Namespace, s: Settings) -> int:
    import aiohttp

    from cleave.runtime.loadgen import runner
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
        print(f"cleave bench: {describe(s.schedule)} to {cfg.endpoint_url} (model {model}); "
              f"{s.workload.describe()}", file=sys.stderr)
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
    return _finish(args, s, cfg, result, started)


def _config(args: argparse.Namespace, s: Settings, cfg: ClientConfig,
            started: float) -> dict[str, Any]:
    from cleave.runtime.loadgen.arrivals import OpenLoop, describe

    sched = s.schedule
    return {
        "url": args.url, "endpoint_url": cfg.endpoint_url, "model": cfg.model,
        "endpoint": args.endpoint, "load": describe(s.schedule),
        "workload": s.workload.describe(),
        "rate": sched.rate if isinstance(sched, OpenLoop) else None,
        "gamma_shape": sched.shape if isinstance(sched, OpenLoop) else None,
        "concurrency": None if isinstance(sched, OpenLoop) else sched.concurrency,
        "num_requests": s.limits.num_requests, "duration_s": s.limits.duration,
        "prompt_len": None if s.workload.prompts else s.workload.prompt_len.describe(),
        "output_len": s.workload.output_len.describe(),
        "prompts_file": str(args.prompts) if args.prompts else None,
        "timeout_s": args.timeout, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }


def _finish(args: argparse.Namespace, s: Settings, cfg: ClientConfig, result: RunResult,
            started: float) -> int:
    from cleave.runtime.loadgen.report import build_report
    from cleave.runtime.loadgen.summary import format_summary

    report = build_report(result.records, result.duration, s.slo,
                          _config(args, s, cfg, started), result.interrupted)
    s.out.mkdir(parents=True, exist_ok=True)
    path = s.out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    if args.plots and result.records:
        from cleave.runtime.loadgen.plots import write_plots

        for png in write_plots(result.records, report, s.out):
            print(f"plot: {png}")
    print(f"report: {path}")
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED_REQUESTS if report["requests"]["failed"] else EXIT_OK
