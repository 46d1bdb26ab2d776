"""Microbench of the default model's (SmolLM2-135M) linear shapes: F.linear in bf16 and fp32
against weights prepacked for oneDNN (dense/linear.py), one thread, weights cycling over 30
distinct layers so they come from memory as in a decode step.

    python bench/linear_micro.py [rows ...]     # default rows: 1 4 16 32
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense.linear import cpu_packs_bf16

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def methods(rows: int, k: int, ws: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    xf = x.float()
    wf = [w.float() for w in ws]
    found: dict[str, Callable[[], object]] = {
        "bf16 F.linear": lambda: [F.linear(x, w) for w in ws],
        "fp32 F.linear": lambda: [F.linear(xf, w) for w in wf],
    }
    if cpu_packs_bf16():  # AVX2-only CPUs have no packed bf16 inner product (dense/linear.py)
        packed = [w.to_mkldnn() for w in ws]
        found["bf16 prepacked"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed]
    return found


def main() -> None:
    torch.set_num_threads(1)
    if not cpu_packs_bf16():
        print("this CPU has no native bf16 (AVX512-BF16/AMX): the engine uses F.linear here; "
              "only the unpacked methods run", flush=True)
    rows_list = [int(r) for r in sys.argv[1:]] or [1, 4, 16, 32]
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for rows in rows_list:
            for method, fn in methods(rows, k, ws).items():
                s = median_seconds(fn)
                print(f"{name:8s} rows={rows:3d} {method:15s} {s * 1e3:7.2f} ms "
                      f"{n * k * 2 * LAYERS / s / 1e9:6.1f} GB/s of bf16 weights", flush=True)


if __name__ == "__main__":
    main()
