"""Structured outputs' cost per token (issue 16 item 3), on the default model at batch 1.

The grammar hook is the sampler's: bring the request's llguidance matcher up to date with the
token just sampled, compute the allowed-token bitmask over SmolLM2's 49152-token vocabulary and
apply it to the logits (``sampler.adjust``). It is timed alone, replaying the tokens of a JSON
answer to a schema one at a time, and set against a batch-1 decode step of the same model
(plain greedy generation through the engine, one torch thread) measured in the same run.
Target: the hook within 10 % of the step.

    python bench/structured.py [--decode-tokens 64]

The last line is one JSON object: ``hook_ms_mean``/``p50``/``p99`` (per token),
``first_mask_ms`` (the first step, which builds the lexer), ``compile_ms`` (a new request's
grammar), ``tokenizer_s`` (once per engine), ``decode_step_ms`` and ``overhead_fraction``
(hook mean / decode step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from cleave.common.settings import DEFAULT_MODEL
from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sampler import adjust
from cleave.runtime.engine.sequence import SamplingParams
from cleave.runtime.serving.structured_fields import grammar

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {
                             "street": {"type": "string"}, "city": {"type": "string"}}}}}
ANSWER = {"name": "Alice Smith", "age": 42, "tags": ["admin", "ops", "on call this week"],
          "address": {"street": "12 Long Road", "city": "Cambridge"}}


def _decode_step_ms(engine: LLMEngine, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.add_request("decode", "Tell me about the weather in spring.", params)
    engine.step()  # the prefill and first token
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _hook_ms(engine: LLMEngine, text: str) -> tuple[list[float], float]:
    """Each token's hook time over one request's answer, and the request's setup time."""
    g = grammar({"guided_json": SCHEMA})
    assert g is not None
    start = time.perf_counter()
    params = SamplingParams(max_tokens=512, grammar=g)
    seq = engine.make_sequence("hook", [1, 2, 3], params)
    compile_ms = 1000 * (time.perf_counter() - start)
    answer = engine.tokenizer.encode(text, add_special_tokens=False)
    logits = torch.randn(1, engine.shape.vocab_size)
    times = []
    for token in answer:
        start = time.perf_counter()
        masked = adjust(logits, [seq])
        times.append(1000 * (time.perf_counter() - start))
        assert masked[0, token] == logits[0, token], "the grammar refused the answer's token"
        seq.token_ids.append(token)
    return times, compile_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=5, help="answers replayed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, num_threads=1),
                       progress=lambda m: print(m, file=sys.stderr))
    start = time.perf_counter()
    engine.grammars.tokenizer()
    tokenizer_s = time.perf_counter() - start
    text = json.dumps(ANSWER, separators=(",", ":"))  # the grammar's compact JSON
    runs = [_hook_ms(engine, text) for _ in range(args.requests)]
    step_ms = _decode_step_ms(engine, args.decode_tokens)
    times = runs[0][0]
    compile_ms = statistics.median(c for _, c in runs)
    first_ms = statistics.median(t[0] for t, _ in runs)  # the first mask builds the lexer
    steady = sorted(x for t, _ in runs for x in t[1:])
    mean = statistics.fmean(steady)
    result = {"library": "llguidance", "vocab": engine.shape.vocab_size, "tokens": len(times),
              "hook_ms_mean": round(mean, 4), "hook_ms_p50": round(steady[len(steady) // 2], 4),
              "hook_ms_p99": round(steady[int(len(steady) * 0.99)], 4),
              "first_mask_ms": round(first_ms, 3), "compile_ms": round(compile_ms, 3),
              "tokenizer_s": round(tokenizer_s, 3), "decode_step_ms": round(step_ms, 2),
              "overhead_fraction": round(mean / step_ms, 4)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
