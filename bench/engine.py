"""Engine benchmark: Cleave vs vLLM's CPU build vs transformers `generate` and continuous batching.

One process, one torch thread, the same requests, the same weights and dtype for all three;
the runs are interleaved (this box drifts 20-50 % over an hour), and medians are reported.
Also measured against same-run hardware baselines: prefill MFU (a 1024-token prefill's useful
FLOP/s over a large bf16 matmul's FLOP/s) and batch-1 decode bandwidth use (weight + KV bytes
read per step over a large tensor read's bandwidth; ``decode_b1_roofline`` counts the weights
only: batch-1 decode tok/s over the weights' bytes / the same run's read bandwidth).
``native_kernels`` says whether the native CPU kernels ran (engine/native: bf16 on an
AVX512-BF16 CPU with a C compiler; ``CLEAVE_NATIVE_KERNELS=0`` turns them off for A/B runs).
``families_identical`` counts the model families (tests/family_models.py) whose tiny random
model the engine runs token for token like transformers, fp32 (the check
tests/runtime/test_families.py asserts).

vLLM (``vllm_tok_s``, ``speedup_vs_vllm``, ``vllm_decode_step_b1_ms``) runs when its venv exists
(``make vllm-env``: .venv-vllm/), never in this process: bench/vllm_engine.py under that venv's
python, fed the same requests over a pipe, started at the beginning (it loads while Cleave
does) and run in the same rounds. Same weights (the converted default model directory, which
vLLM reads as safetensors), same dtype, greedy, EOS ignored, token ids in and out (no
detokenization on either), prefix caching off on vLLM (Cleave's is reset before each run and
the random prompts share no block). Core budget for the model's compute: one core each. Cleave
runs one torch thread; vLLM's model worker runs one OpenMP thread bound to one core
(VLLM_CPU_OMP_THREADS_BIND=<core>, which also pins that process), its front-end and engine-core
processes get OMP_NUM_THREADS=1 and are not pinned (vLLM reserves a core for its scheduler
process; Cleave schedules on its one thread). vLLM keeps its own CPU defaults otherwise
(torch.compile'd model, chunked prefill, its batch budgets, logged). Its first start compiles
for minutes (cached under ~/.cache/vllm after). ``--quick`` skips vLLM; ``--vllm off`` too.
Without the venv the JSON says ``"vllm": "absent"`` and the vLLM figures are null.

    python bench/engine.py            # 32 requests, 2 rounds (~7 min on 2 CPU cores with vLLM)
    python bench/engine.py --quick    # 16 requests, 1 round, no vLLM (<3 min)
    PYTHONPATH=<tree>/runtime:... python bench/engine.py --quick --cleave-only  # A/B runs

The last line is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from hf_baselines import run_hf_continuous_batching, run_hf_generate
from vllm_client import start_vllm

from cleave.runtime.engine.config import EngineConfig
from cleave.runtime.engine.llm_engine import LLMEngine
from cleave.runtime.engine.native.build import build
from cleave.runtime.engine.native.kernels import kernels
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


def native_status(engine: LLMEngine) -> str:
    """Whether this run's engine used the native CPU kernels (engine/native), or why not."""
    if getattr(engine.model, "native_layers", None) is not None:
        return "on"
    if kernels() is None:
        return f"off: {build().reason}"
    return "partly: not the one-call layer (the model's layers are not Llama-shaped)"


def count_families() -> tuple[int, int]:
    """(families token-identical to transformers, families checked), on tiny fp32 models."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from family_models import FAMILIES, count_identical  # type: ignore[import-not-found]

    with tempfile.TemporaryDirectory() as root:
        return count_identical(Path(root)), len(FAMILIES)


def cleave_only(engine: LLMEngine, requests: Requests, rounds: int, seed: int) -> int:
    run_cleave(engine, [(p, 4) for p, _ in requests[:2]])
    tok_s = []
    for r in range(rounds):
        tokens, seconds, _ = run_cleave(engine, requests)
        tok_s.append(tokens / seconds)
        log(f"round {r + 1}: cleave {tokens} tokens in {seconds:6.2f} s = {tok_s[-1]:6.1f} tok/s")
    _, prefill_s = prefill_mfu(engine, 1.0, random.Random(seed + 1))
    _, step_s = decode_bandwidth(engine, 1.0)
    print(json.dumps({"cleave_tok_s": round(statistics.median(tok_s), 1),
                      "native_kernels": native_status(engine),
                      "rounds_tok_s": [round(t, 1) for t in tok_s],
                      "prefill_1024_ms": round(prefill_s * 1e3, 1),
                      "decode_step_b1_ms": round(step_s * 1e3, 2),
                      "requests": len(requests)}))
    return 0


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
    parser.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                        help="auto: when .venv-vllm exists, not with --quick")
    parser.add_argument("--vllm-core", type=int, default=None,
                        help="core for vLLM's model thread (default: the last one allowed)")
    parser.add_argument("--cleave-only", action="store_true",
                        help="only Cleave's figures (tok/s per round, batch-1 decode step, "
                        "1024-token prefill): for A/B runs of two engine versions, whose "
                        "PYTHONPATH picks which Cleave runs; no baseline runs in the same "
                        "process, so interleave the two versions' runs and compare medians")
    args = parser.parse_args()
    n_requests = args.requests or (16 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    num_threads=args.threads, kv_cache_bytes=2 << 30),
                       progress=log)
    if args.cleave_only:
        return cleave_only(engine, make_requests(n_requests, args.seed, engine.shape.vocab_size),
                           rounds, args.seed)
    vllm, vllm_status = start_vllm(args.vllm, args.quick, engine.model_files.directory,
                                   engine.dtype, args.vllm_core, log)
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
    if vllm is not None:
        try:
            ready = vllm.wait_ready()
            vllm_status = ready["vllm"]
            log(f"vLLM {ready['vllm']} ready: max_num_batched_tokens "
                f"{ready['max_num_batched_tokens']}, max_num_seqs {ready['max_num_seqs']}, "
                f"chunked prefill {ready['chunked_prefill']}")
        except RuntimeError as e:
            log(f"vLLM failed to start, no vLLM figures: {e}")
            vllm, vllm_status = None, "failed"

    runs: dict[str, list[float]] = {"cleave": [], "generate": [], "cb": [], "vllm": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = ["cleave", "generate", "cb"]
        if vllm is not None:
            order.insert(1, "vllm")
        order = order[r % len(order):] + order[:r % len(order)]
        for name in order:
            if name == "vllm":
                if vllm is None:
                    continue
                try:
                    reply = vllm.call({"op": "generate", "requests": requests})
                except RuntimeError as e:
                    log(f"vLLM failed mid-run, no further vLLM runs: {e}")
                    vllm, vllm_status = None, "failed"
                    continue
                tokens, seconds, out = reply["tokens"], reply["seconds"], reply["outputs"]
            elif name == "cleave":
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
    vllm_same = None
    if "vllm" in outputs:
        vllm_same = sum(a == b for a, b in zip(outputs["cleave"], outputs["vllm"], strict=True))
        log(f"greedy outputs identical to vLLM: {vllm_same}/{n_requests}")

    rng = random.Random(args.seed + 1)
    peak = matmul_flops(engine.device, engine.dtype)
    mfu, prefill_s = prefill_mfu(engine, peak, rng)
    log(f"matmul {peak / 1e12:.3f} TFLOP/s; 1024-token prefill {prefill_s * 1e3:.0f} ms "
        f"-> MFU {mfu:.2f}")
    bandwidth = read_bandwidth(engine.device)
    bw_util, step_s = decode_bandwidth(engine, bandwidth)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; batch-1 decode step "
        f"{step_s * 1e3:.1f} ms -> bandwidth use {bw_util:.2f}")
    vllm_step_ms = None
    if vllm is not None:
        try:
            reply = vllm.call({"op": "decode_b1", "context": 256, "steps": 40, "repeats": 3})
            vllm_step_ms = reply["step_ms"]
            log(f"vLLM batch-1 decode step {vllm_step_ms:.1f} ms (256-token context; from "
                "outside: (41-token request - 1-token request) / 40, medians of 3)")
        except RuntimeError as e:
            log(f"vLLM failed in its batch-1 decode: {e}")
        vllm.close()

    families_identical, families = count_families()
    log(f"model families token-identical to transformers (fp32, tiny models): "
        f"{families_identical}/{families}")

    cleave, gen, cb = (statistics.median(runs[k]) for k in ("cleave", "generate", "cb"))
    vllm_tok_s = statistics.median(runs["vllm"]) if runs["vllm"] else None
    if vllm_tok_s is not None:
        log(f"Cleave {cleave:.1f} tok/s vs vLLM {vllm_tok_s:.1f} tok/s (medians) -> "
            f"{cleave / vllm_tok_s:.2f}x")
    print(json.dumps({
        "cleave_tok_s": round(cleave, 1),
        "hf_generate_tok_s": round(gen, 1),
        "hf_cb_tok_s": round(cb, 1),
        "speedup_vs_generate": round(cleave / gen, 2),
        "speedup_vs_cb": round(cleave / cb, 2),
        "prefill_mfu": round(mfu, 3),
        "decode_bw_util": round(bw_util, 3),
        "decode_b1_roofline": round(engine.model.weight_bytes() / bandwidth / step_s, 3),
        "matmul_tflops": round(peak / 1e12, 3),
        "read_gbps": round(bandwidth / 1e9, 1),
        "prefill_1024_ms": round(prefill_s * 1e3, 1),
        "decode_step_b1_ms": round(step_s * 1e3, 2),
        "vllm_tok_s": None if vllm_tok_s is None else round(vllm_tok_s, 1),
        "speedup_vs_vllm": None if vllm_tok_s is None else round(cleave / vllm_tok_s, 2),
        "vllm_decode_step_b1_ms": None if vllm_step_ms is None else round(vllm_step_ms, 2),
        "vllm_identical_to_cleave": None if vllm_same is None else f"{vllm_same}/{n_requests}",
        "vllm": vllm_status,
        "identical_to_generate": f"{same}/{n_requests}",
        "families_identical": families_identical,
        "requests": n_requests, "rounds": rounds,
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "native_kernels": native_status(engine),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
