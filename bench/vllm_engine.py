"""vLLM's side of bench/engine.py, run by the vLLM venv's python (``make vllm-env``).

Never imported by Cleave: bench/engine.py starts it as a subprocess with
``.venv-vllm/bin/python`` and talks to it over pipes, one JSON object a line. It loads the model
once, answers ``{"ready": ...}``, then serves one command a line on stdin until EOF:

    {"op": "generate", "requests": [[prompt_ids, max_tokens], ...]}
        -> {"tokens": n, "seconds": s, "outputs": [[token ids], ...]}
    {"op": "decode_b1", "context": 256, "steps": 40, "repeats": 3}
        -> {"step_ms": ms, "prefill_ms": ms}

Greedy, EOS ignored, no detokenization, token ids in and out. Batch-1 decode is measured from
outside the engine: (time of a request with 1 + steps output tokens - time of the same request
with 1) / steps, medians over ``repeats``. Results go to the original stdout; everything vLLM
prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # Results on a private copy of stdout; stdout itself (and so every child process's) -> stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]  # its venv only

    llm: Any = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype,
                   enable_prefix_caching=False, max_model_len=args.max_model_len,
                   seed=args.seed)
    sched: Any = llm.llm_engine.vllm_config.scheduler_config
    import vllm  # type: ignore[import-not-found]

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")

    def generate(requests: list[tuple[list[int], int]]) -> tuple[int, float, list[list[int]]]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                 detokenize=False) for _, n in requests]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = [list(r.outputs[0].token_ids) for r in results]
        return sum(len(o) for o in outputs), seconds, outputs

    generate([([7] * 64, 4), ([8] * 96, 4)])  # warm-up
    reply({"ready": True, "vllm": vllm.__version__,
           "max_num_batched_tokens": sched.max_num_batched_tokens,
           "max_num_seqs": sched.max_num_seqs,
           "chunked_prefill": sched.enable_chunked_prefill})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            tokens, seconds, outputs = generate([(p, n) for p, n in cmd["requests"]])
            reply({"tokens": tokens, "seconds": seconds, "outputs": outputs})
        elif cmd["op"] == "decode_b1":
            prompt = [7] * int(cmd.get("context", 256))
            steps, repeats = int(cmd.get("steps", 40)), int(cmd.get("repeats", 3))
            generate([(prompt, 1 + steps)])  # warm-up at this shape
            short = [generate([(prompt, 1)])[1] for _ in range(repeats)]
            long = [generate([(prompt, 1 + steps)])[1] for _ in range(repeats)]
            prefill = statistics.median(short)
            reply({"step_ms": (statistics.median(long) - prefill) / steps * 1e3,
                   "prefill_ms": prefill * 1e3})
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
