"""Where an engine step's time goes: torch.profiler over a prefill-heavy and a decode-heavy mix.

One torch thread, bf16, the default model (as bench/engine.py). Each mix runs once to warm up,
then once under the profiler. The engine is not modified: its phases are wrapped from outside
in ``record_function`` ranges (schedule, prepare = batch metadata, forward, of which attention,
sample); ``step other`` is the rest of ``LLMEngine.step`` (commit, outputs, detokenization).

    python bench/profile_engine.py              # both mixes (~2 min on 2 CPU cores)
    python bench/profile_engine.py --trace DIR  # also write Chrome traces there
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import cleave.runtime.engine.dense.decoder as decoder_module
import cleave.runtime.engine.model_runner as runner_module
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams

PHASES = ["step", "schedule", "prepare", "forward", "attention", "sample"]

MIXES: dict[str, tuple[int, tuple[int, int], tuple[int, int]]] = {
    # name: (requests, prompt length range, output length range)
    "prefill-heavy": (12, (384, 512), (4, 8)),
    "decode-heavy": (16, (32, 64), (96, 128)),
}


def wrapped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"phase::{name}"):
            return fn(*args, **kwargs)
    return inner


def instrument(engine: LLMEngine) -> None:
    engine.step = wrapped("step", engine.step)  # type: ignore[method-assign]
    engine.scheduler.schedule = wrapped(  # type: ignore[method-assign]
        "schedule", engine.scheduler.schedule)
    engine.runner.prepare = wrapped("prepare", engine.runner.prepare)  # type: ignore[method-assign]
    engine.model.forward = wrapped("forward", engine.model.forward)  # type: ignore[method-assign]
    for module, attr, name in ((runner_module, "sample", "sample"),
                               (decoder_module, "paged_attention", "attention")):
        setattr(module, attr, wrapped(name, getattr(module, attr)))


def requests(n: int, prompt: tuple[int, int], output: tuple[int, int],
             seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(*prompt))],
             rng.randint(*output)) for _ in range(n)]


def run(engine: LLMEngine, reqs: list[tuple[list[int], int]]) -> float:
    engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    engine.generate([p for p, _ in reqs],
                    [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--trace", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                                    num_threads=1, kv_cache_bytes=1 << 30),
                       progress=lambda m: print(m, file=sys.stderr))
    instrument(engine)
    for seed, (name, (n, prompt, output)) in enumerate(MIXES.items()):
        reqs = requests(n, prompt, output, seed)
        run(engine, reqs[:4])  # warm-up
        steps_before = engine.stats.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            seconds = run(engine, reqs)
        steps = engine.stats.steps - steps_before
        prompt_tokens = sum(len(p) for p, _ in reqs)
        output_tokens = sum(o for _, o in reqs)
        events = prof.key_averages()
        phase = {e.key.removeprefix("phase::"): e.cpu_time_total / 1e6 for e in events
                 if e.key.startswith("phase::")}
        step_total = phase.get("step", seconds)
        print(f"\n## {name}: {n} requests, {prompt_tokens} prompt + {output_tokens} output "
              f"tokens, {steps} steps, {seconds:.2f} s ({seconds / steps * 1e3:.1f} ms/step, "
              f"{output_tokens / seconds:.1f} tok/s; profiler overhead included)")
        print("| phase | s | share of step time |\n|---|---|---|")
        accounted = 0.0
        for key in PHASES[1:]:
            value = phase.get(key, 0.0)
            if key != "attention":
                accounted += value
            label = "  of which attention" if key == "attention" else key
            print(f"| {label} | {value:.2f} | {value / step_total:.0%} |")
        other = step_total - accounted
        print(f"| step other | {other:.2f} | {other / step_total:.0%} |")
        print("\n| op (self CPU) | s | share | calls |\n|---|---|---|---|")
        ops = sorted((e for e in events if not e.key.startswith("phase::")),
                     key=lambda e: e.self_cpu_time_total, reverse=True)
        total_self = sum(e.self_cpu_time_total for e in ops)
        for e in ops[:args.top]:
            print(f"| `{e.key}` | {e.self_cpu_time_total / 1e6:.2f} | "
                  f"{e.self_cpu_time_total / total_self:.0%} | {e.count} |")
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{name}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
