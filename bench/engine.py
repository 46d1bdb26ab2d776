"""Engine benchmark: Cleave vs transformers `generate` vs transformers continuous batching.

One process, one torch thread, the same requests, the same weights and dtype for all three;
the runs are interleaved (this box drifts 20-50 % over an hour), and medians are reported.
Also measured against same-run hardware baselines: prefill MFU (a 1024-token prefill's useful
FLOP/s over a large bf16 matmul's FLOP/s) and batch-1 decode bandwidth use (weight + KV bytes
read per step over a large tensor read's bandwidth).

    python bench/engine.py            # 32 requests, 2 rounds (~5 min on 2 CPU cores)
    python bench/engine.py --quick    # 16 requests, 1 round (<3 min)

The last line is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from hf_baselines import run_hf_continuous_batching, run_hf_generate

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.sequence import SamplingParams

Requests = list[tuple[list[int], int]]


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def make_requests(n: int, seed: int, vocab: int) -> Requests:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))],
             rng.randint(16, 128)) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_cleave(engine: LLMEngine, requests: Requests) -> tuple[int, float, list[list[int]]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in requests]
    engine.block_manager.reset_prefix_cache()  # no prefix hits carried over from a warm-up
    sync(engine.device)
    start = time.perf_counter()
    results = engine.generate([p for p, _ in requests], params)
    sync(engine.device)
    seconds = time.perf_counter() - start
    outputs = [r.token_ids for r in results]
    return sum(len(o) for o in outputs), seconds, outputs


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / timed(lambda: a @ b, device, 5)


def read_bandwidth(device: torch.device) -> float:
    """Bytes/s of a plain reduction over a buffer far larger than any cache."""
    x = torch.ones((512 << 20) // 4, dtype=torch.float32, device=device)
    return x.numel() * 4 / timed(lambda: x.sum(), device, 5)


def prefill_mfu(engine: LLMEngine, peak: float, rng: random.Random) -> tuple[float, float]:
    """Useful FLOP/s of a 1024-token prefill over ``peak``; returns (mfu, seconds)."""
    s, n = engine.shape, 1024
    linear = s.param_count(include_embeddings=False) - (2 * s.num_layers + 1) * s.hidden_size
    attention = 2 * 2 * s.num_layers * s.num_heads * s.head_dim * n * (n + 1) / 2  # causal
    flops = 2 * linear * n + attention + 2 * s.vocab_size * s.hidden_size  # lm_head: last token

    def once() -> None:  # a fresh prompt each time: no prefix-cache hit
        engine.generate([[rng.randrange(100, 40000) for _ in range(n)]],
                        SamplingParams(max_tokens=1))

    seconds = timed(once, engine.device, 3)
    return flops / seconds / peak, seconds


def decode_bandwidth(engine: LLMEngine, bandwidth: float) -> tuple[float, float]:
    """Batch-1 decode: (weight + KV bytes read per step) / step time / read bandwidth."""
    s = engine.shape
    context = 256
    engine.add_request("bw", [7] * context, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # prefill
    steps = []
    while engine.has_unfinished:
        sync(engine.device)
        start = time.perf_counter()
        engine.step()
        sync(engine.device)
        steps.append(time.perf_counter() - start)
    step = statistics.median(steps)
    elem = torch.empty((), dtype=engine.dtype).element_size()
    kv_bytes = (context + len(steps) // 2) * 2 * s.num_layers * s.num_kv_heads * s.head_dim * elem
    return (engine.model.weight_bytes() + kv_bytes) / step / bandwidth, step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests, one round")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model name or local path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_requests = args.requests or (16 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    num_threads=args.threads, kv_cache_bytes=2 << 30),
                       progress=log)
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(engine.model_files.directory),
                                                   dtype=engine.dtype)
    hf = hf.to(engine.device).eval()
    requests = make_requests(n_requests, args.seed, engine.shape.vocab_size)
    log(f"{n_requests} requests, prompts 32-512, outputs 16-128, {rounds} round(s), "
        f"{engine.dtype}, {engine.device}, {args.threads} thread(s)")
    warm = requests[:2]
    run_cleave(engine, [(p, 4) for p, _ in warm])
    run_hf_generate(hf, [(p, 4) for p, _ in warm])

    runs: dict[str, list[float]] = {"cleave": [], "generate": [], "cb": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = ["cleave", "generate", "cb"]
        order = order[r % 3:] + order[:r % 3]
        for name in order:
            if name == "cleave":
                tokens, seconds, out = run_cleave(engine, requests)
            elif name == "generate":
                res = run_hf_generate(hf, requests)
                tokens, seconds, out = res.useful_tokens, res.seconds, res.outputs
            else:
                # Its best measured configuration here: sdpa, 512 batch tokens, 16 requests.
                res = run_hf_continuous_batching(hf, requests, num_blocks=1024,
                                                 max_requests_per_batch=16)
                tokens, seconds, out = res.useful_tokens, res.seconds, res.outputs
            runs[name].append(tokens / seconds)
            outputs[name] = out
            log(f"round {r + 1}: {name:8s} {tokens} tokens in {seconds:6.2f} s = "
                f"{tokens / seconds:6.1f} tok/s")
    same = sum(a == b for a, b in zip(outputs["cleave"], outputs["generate"], strict=True))
    log(f"greedy outputs identical to transformers generate: {same}/{n_requests} "
        "(bf16 rounding can flip near-ties)")

    rng = random.Random(args.seed + 1)
    peak = matmul_flops(engine.device, engine.dtype)
    mfu, prefill_s = prefill_mfu(engine, peak, rng)
    log(f"matmul {peak / 1e12:.3f} TFLOP/s; 1024-token prefill {prefill_s * 1e3:.0f} ms "
        f"-> MFU {mfu:.2f}")
    bandwidth = read_bandwidth(engine.device)
    bw_util, step_s = decode_bandwidth(engine, bandwidth)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; batch-1 decode step "
        f"{step_s * 1e3:.1f} ms -> bandwidth use {bw_util:.2f}")

    cleave, gen, cb = (statistics.median(runs[k]) for k in ("cleave", "generate", "cb"))
    print(json.dumps({
        "cleave_tok_s": round(cleave, 1),
        "hf_generate_tok_s": round(gen, 1),
        "hf_cb_tok_s": round(cb, 1),
        "speedup_vs_generate": round(cleave / gen, 2),
        "speedup_vs_cb": round(cleave / cb, 2),
        "prefill_mfu": round(mfu, 3),
        "decode_bw_util": round(bw_util, 3),
        "matmul_tflops": round(peak / 1e12, 3),
        "read_gbps": round(bandwidth / 1e9, 1),
        "prefill_1024_ms": round(prefill_s * 1e3, 1),
        "decode_step_b1_ms": round(step_s * 1e3, 2),
        "identical_to_generate": f"{same}/{n_requests}",
        "requests": n_requests, "rounds": rounds,
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
