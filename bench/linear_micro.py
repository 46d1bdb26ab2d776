"""Microbench of the default model's (SmolLM2-135M) linear shapes: the native GEMM over packed
weights (engine/native/gemm.c, where it runs) against F.linear in bf16 and fp32 and weights
prepacked for oneDNN (dense/linear.py), one thread, weights cycling over 30 distinct layers so
they come from memory as in a decode step. Where the native kernels run, also the gate_up
shape with SiLU-and-mul fused into the GEMM's epilogue against the same GEMM followed by
torch's ``F.silu(gate) * up`` (what the engine runs where it cannot fuse). The last line is
JSON: per row count, each method's ms for all four shapes' 30 layers (a forward's linears but
the LM head), the native kernel's speedup over the fastest oneDNN method, and the fused
gate_up's ms against the unfused.

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
        for rows, t in totals.items()}, "gate_up_silu": fused_gate_up(rows_list)}))


def fused_gate_up(rows_list: list[int]) -> dict[int, dict[str, float]]:
    """30 layers' gate_up and SiLU-and-mul: fused into gemm.c's epilogue, and the same GEMM
    then torch's ops, alternating in one run (medians of 5 each)."""
    native = kernels()
    if native is None:
        return {}
    n, k = SHAPES["gate_up"]
    ws = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    fused = [Kernels.pack(w, gated=True) for w in ws]
    plain = [Kernels.pack(w) for w in ws]
    out: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {"fused_ms": [], "unfused_ms": []}
        for _ in range(6):  # the first round warms up
            for key, run in (("fused_ms", _fused), ("unfused_ms", _unfused)):
                start = time.perf_counter()
                run(native, x, fused if key == "fused_ms" else plain, n)
                times[key].append((time.perf_counter() - start) * 1e3)
        out[rows] = {key: round(statistics.median(t[1:]), 2) for key, t in times.items()}
        print(f"gate_up+silu rows={rows:3d} fused {out[rows]['fused_ms']:7.2f} ms, unfused "
              f"{out[rows]['unfused_ms']:7.2f} ms", flush=True)
    return out


def _fused(native: Kernels, x: torch.Tensor, packs: list[torch.Tensor], n: int) -> None:
    for p in packs:
        native.packed_linear(x, p, n // 2, silu=True)


def _unfused(native: Kernels, x: torch.Tensor, packs: list[torch.Tensor], n: int) -> None:
    for p in packs:
        gate, up = native.packed_linear(x, p, n).chunk(2, dim=-1)
        F.silu(gate) * up


def native_speedup(total_ms: dict[str, float]) -> dict[str, float]:
    onednn = [v for m, v in total_ms.items() if m.startswith("bf16") and "native" not in m]
    if "bf16 native" not in total_ms or not onednn:
        return {}
    return {"native_speedup": round(min(onednn) / total_ms["bf16 native"], 2)}


if __name__ == "__main__":
    main()
