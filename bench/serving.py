"""Serving benchmark: disaggregated (1 prefill + 1 decode worker) vs colocated workers.

Low load: both deployments run at once on this machine, each started by ``cleave up`` (its own
redis-server, workers and router), serving SmolLM2-135M; requests go through each router with
the official ``openai`` client, one at a time, alternating between the two so drift hits both
alike. Each request has a fresh 512-token prompt (no prefix-cache help) and asks for 64 greedy
tokens. TTFT is the time to the first streamed token; TPOT is the time per token after it.

Prompt-heavy load (issue 18's): ``cleave bench`` at concurrency 8, prompts of 100-400 words,
64 output tokens, goodput objective TTFT <= 2 s and TPOT <= 200 ms, against the default split
(``cleave up``: one prefill, one decode worker, with its convertible routing) and two colocated
workers (``--prefill 0 --decode 2``), one deployment at a time, in alternating rounds.

    python bench/serving.py [--quick] [--only low|prompt-heavy]

The last line is one JSON object with the medians and the disaggregated/colocated ratios, and
``prompt_heavy_goodput_default``, ``prompt_heavy_goodput_colocated`` (SLO attainment) and
``prompt_heavy_ttft_p90_ratio`` (default / colocated).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from cleave.runtime.serving.up import said_port

MODEL = "smollm2-135m-instruct"
PROMPT_TOKENS = 512
OUTPUT_TOKENS = 64


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def start(name: str, prefill: int, logdir: Path,
          decode: int = 1) -> tuple[subprocess.Popen[bytes], int]:
    """``cleave up`` on a free port (``--port 0``: it binds one itself, so nothing takes it
    first); the process and the port its "Cleave is up" line says."""
    path = logdir / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cleave.common.cli", "up", "--prefill", str(prefill),
         "--decode", str(decode), "--port", "0", "--disaggregate-min-tokens", "64"],
        stdout=path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {path.read_text()[-2000:]}")
        port = said_port(path.read_text(errors="replace"))
        if port is not None:
            log(f"{name} deployment ready on port {port}")
            return proc, port
        time.sleep(0.5)
    raise RuntimeError(f"{name} not ready in time")


def one_request(client: openai.OpenAI, prompt: list[int]) -> tuple[float, float, int]:
    """(ttft, tpot, tokens) of one streamed greedy completion."""
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                       temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            if not first:
                first = now
            last = now
            tokens += 1
    ttft = first - start
    tpot = (last - first) / max(tokens - 1, 1)
    return ttft, tpot, tokens


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def low_load(n: int, logdir: Path) -> dict[str, object]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports: dict[str, int] = {}
        for key, prefill in (("disagg", 1), ("colocated", 0)):
            proc, ports[key] = start(key, prefill, logdir)
            procs.append(proc)
        clients = {k: openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="-",
                                    max_retries=0, timeout=120) for k, p in ports.items()}
        rng = random.Random(0)

        def prompt() -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]

        for client in clients.values():  # warm-up: first-call costs are not the subject
            one_request(client, prompt())
        results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in clients}
        for i in range(n):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                results[name].append(one_request(clients[name], prompt()))
            d, c = results["disagg"][-1], results["colocated"][-1]
            log(f"{i + 1}/{n}: disagg ttft {d[0] * 1e3:.0f} ms tpot {d[1] * 1e3:.1f} ms | "
                f"colocated ttft {c[0] * 1e3:.0f} ms tpot {c[1] * 1e3:.1f} ms")
    finally:
        stop(procs)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in results.items()}
    tokens = statistics.median(r[2] for v in results.values() for r in v)
    return {
        "ttft_disagg_ms": round(med["disagg"][0] * 1e3, 1),
        "ttft_colocated_ms": round(med["colocated"][0] * 1e3, 1),
        "ttft_ratio": round(med["disagg"][0] / med["colocated"][0], 3),
        "tpot_disagg_ms": round(med["disagg"][1] * 1e3, 2),
        "tpot_colocated_ms": round(med["colocated"][1] * 1e3, 2),
        "tpot_ratio": round(med["disagg"][1] / med["colocated"][1], 3),
        "requests": n, "prompt_tokens": PROMPT_TOKENS, "median_output_tokens": tokens}


def bench_round(port: int, n: int, seed: int, out: Path) -> dict[str, Any]:
    """One ``cleave bench`` run of the prompt-heavy load; its report."""
    subprocess.run([sys.executable, "-m", "cleave.common.cli", "bench",
                    "--url", f"http://127.0.0.1:{port}", "--concurrency", "8",
                    "--num-requests", str(n), "--prompt-len", "uniform:100-400",
                    "--output-len", "64",
                    "--ttft-slo", "2", "--tpot-slo", "0.2", "--seed", str(seed),
                    "--out", str(out), "--no-plots"], check=False, capture_output=True)
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def prompt_heavy(rounds: int, per_round: int, logdir: Path) -> dict[str, object]:
    """Each setup started once; rounds alternate between them (one running at a time would
    leave the other's processes idle but resident, as both are here)."""
    setups = {"default": (1, 1), "colocated": (0, 2)}
    procs: list[subprocess.Popen[bytes]] = []
    ttfts: dict[str, list[float]] = {k: [] for k in setups}
    good = {k: 0 for k in setups}
    tried = {k: 0 for k in setups}
    try:
        ports: dict[str, int] = {}
        for k, (prefill, decode) in setups.items():
            proc, ports[k] = start(f"heavy-{k}", prefill, logdir, decode)
            procs.append(proc)
        for i in range(rounds):
            order = list(setups) if i % 2 == 0 else list(reversed(setups))
            for k in order:
                r = bench_round(ports[k], per_round, i, logdir / f"{k}-{i}")
                ttfts[k] += [x["ttft_ms"] for x in r["per_request"] if x["ttft_ms"] is not None]
                good[k] += r["goodput"]["good_requests"]
                tried[k] += r["requests"]["completed"] + r["requests"]["failed"]
                log(f"round {i + 1}/{rounds} {k}: attainment {r['goodput']['attainment']:.2f} "
                    f"p90 ttft {r['latency_ms']['ttft']['p90']:.0f} ms "
                    f"failed {r['requests']['failed']}")
    finally:
        stop(procs)
    p90 = {k: statistics.quantiles(v, n=10)[-1] for k, v in ttfts.items()}
    return {"prompt_heavy_goodput_default": round(good["default"] / tried["default"], 3),
            "prompt_heavy_goodput_colocated": round(good["colocated"] / tried["colocated"], 3),
            "prompt_heavy_ttft_p90_default_ms": round(p90["default"], 1),
            "prompt_heavy_ttft_p90_colocated_ms": round(p90["colocated"], 1),
            "prompt_heavy_ttft_p90_ratio": round(p90["default"] / p90["colocated"], 3),
            "prompt_heavy_requests": tried["default"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="6 low-load requests each, 2 prompt-heavy rounds of 24")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--only", choices=("low", "prompt-heavy"), default=None)
    args = parser.parse_args()
    n = args.requests or (6 if args.quick else 20)
    logdir = Path(tempfile.mkdtemp(prefix="cleave-bench-serving-"))
    result: dict[str, object] = {}
    if args.only in (None, "low"):
        result |= low_load(n, logdir)
    if args.only in (None, "prompt-heavy"):
        result |= prompt_heavy(2 if args.quick else 4, 24 if args.quick else 48, logdir)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
