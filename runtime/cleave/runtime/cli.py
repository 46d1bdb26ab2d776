"""``cleave generate``, and the engine configuration every runtime subcommand builds.

The ``cleave`` command itself is ``cleave.common.cli``: it imports this module only for
``cleave generate``.
"""

from __future__ import annotations

import argparse
import sys
import time

from cleave.common.settings import EngineSettings
from cleave.runtime.engine.config import EngineConfig


def engine_config(engine: EngineSettings, salt: str = "") -> EngineConfig:
    return EngineConfig(
        model=engine.model, revision=engine.revision, dtype=engine.dtype, device=engine.device,
        kv_cache_bytes=engine.kv_cache_memory, max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_batched_tokens, max_model_len=engine.max_model_len,
        num_threads=engine.threads, salt=salt,
        tensor_parallel_size=engine.tensor_parallel_size)


def _generate(args: argparse.Namespace) -> int:
    from cleave.runtime.engine.llm_engine import LLMEngine
    from cleave.runtime.engine.sequence import RequestError, SamplingParams
    from cleave.runtime.models.loader import ModelLoadError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop or ()))
        engine = LLMEngine(engine_config(EngineSettings.from_args(args)))
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


def add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    EngineSettings.add_arguments(gen)
    gen.set_defaults(func=_generate)

