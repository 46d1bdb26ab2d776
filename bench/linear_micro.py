"""Microbench of the default model's (SmolLM2-135M) linear shapes: the native GEMM over packed
weights (engine/native/gemm.c, where it runs) against F.linear in bf16 and fp32 and weights
prepacked for oneDNN (dense/linear.py), one thread, weights cycling over 30 distinct layers so
they come from memory as in a decode step. The last line is JSON: per row count, each method's
ms for all four shapes' 30 layers (a forward's linears but the LM head), and the native
kernel's speedup over the fastest oneDNN method.

    python bench/linear_micro.py [rows ...]     # default rows: 1 4 8 16 32 64 512
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense.linear import cpu_packs_bf16
from cleave.runtime.engine.native.kernels import Kernels, kernels

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
    native = kernels()
    if native is not None and k % 32 == 0:
        packs = [(Kernels.pack(w), w.shape[0]) for w in ws]
        found["bf16 native"] = lambda: [native.packed_linear(x, p, n) for p, n in packs]
    return found


def main() -> None:
    torch.set_num_threads(1)
    if not cpu_packs_bf16():
        print("this CPU has no native bf16 (AVX512-BF16/AMX): the engine uses F.linear here; "
              "only the unpacked methods run", flush=True)
    rows_list = [int(r) for r in sys.argv[1:]] or [1, 4, 8, 16, 32, 64, 512]
    totals: dict[int, dict[str, float]] = {rows: {} for rows in rows_list}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for rows in rows_list:
            for method, fn in methods(rows, k, ws).items():
                s = median_seconds(fn)
                totals[rows][method] = totals[rows].get(method, 0.0) + s * 1e3
                print(f"{name:8s} rows={rows:3d} {method:15s} {s * 1e3:7.2f} ms "
                      f"{n * k * 2 * LAYERS / s / 1e9:6.1f} GB/s of bf16 weights", flush=True)
    print(json.dumps({"native_kernels": kernels() is not None, "rows": {
        rows: {**{m: round(v, 2) for m, v in t.items()}, **native_speedup(t)}
        for rows, t in totals.items()}}))


def native_speedup(total_ms: dict[str, float]) -> dict[str, float]:
    onednn = [v for m, v in total_ms.items() if m.startswith("bf16") and "native" not in m]
    if "bf16 native" not in total_ms or not onednn:
        return {}
    return {"native_speedup": round(min(onednn) / total_ms["bf16 native"], 2)}


if __name__ == "__main__":
    main()
