"""Prefill/decode cost model of one replica: DESIGN.md's arithmetic with named GPU constants.

Prefill is compute-bound, ``t = 2 · N · n / achieved_FLOPs`` (plus the causal attention term,
which the design formula leaves out and which matters for long prompts); decode is
bandwidth-bound, ``t_step = (weight_bytes + kv_bytes) / achieved_bandwidth``, or compute-bound
when the batch is very large. Peak figures are the vendors' dense datasheet numbers; the
*achieved* fractions are stated here once and used everywhere (docs/simulator.md gives sources).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9


def prefill_tokens_per_second(n_params: float, achieved_flops: float) -> float:
    """Prompt tok/s of one prefill replica, from t = 2 * N * n_input / FLOPs (DESIGN.md)."""
    return achieved_flops / (2.0 * n_params)


@dataclass(frozen=True)
class Gpu:
    name: str
    flops: float  # dense bf16 FLOP/s, peak (or measured when achieved_* are 1)
    bandwidth: float  # memory bytes/s, peak
    memory: float  # bytes per device
    compute_efficiency: float = 0.45  # prefill MFU incl. tensor-parallel all-reduces
    bandwidth_efficiency: float = 0.70  # share of peak HBM bandwidth a decode step reaches


# Datasheet dense bf16 (without sparsity) and HBM figures of the SXM parts.
GPUS = {
    "H200": Gpu("H200", 989.4e12, 4.8e12, 141 * GB),
    "H100": Gpu("H100", 989.4e12, 3.35e12, 80 * GB),
    "A100": Gpu("A100", 312e12, 2.039e12, 80 * GB),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_elem: int = 2  # bf16 weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_elem

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_elem


MODELS = {
    "70b": ModelShape("Llama-3-70B", 70.55e9, 80, 8192, 8, 128),
    "8b": ModelShape("Llama-3-8B", 8.03e9, 32, 4096, 8, 128),
    "smollm2-135m": ModelShape("SmolLM2-135M", 134.5e6, 30, 576, 3, 64),
}


def default_tensor_parallel(model: ModelShape, gpu: Gpu, weight_share: float = 0.6) -> int:
    """Smallest power-of-two group whose memory holds the weights in ``weight_share`` of it,
    leaving the rest for KV and activations (70B on H200: 2; on H100 or A100: 4)."""
    tp = 1
    while model.weight_bytes > weight_share * tp * gpu.memory:
        tp *= 2
        if tp > 64:
            raise ValueError(f"{model.name} does not fit on 64 x {gpu.name}")
    return tp


@dataclass(frozen=True)
class CostModel:
    gpu: Gpu
    model: ModelShape
    prefill_tp: int
    decode_tp: int
    memory_utilization: float = 0.90  # share of device memory the engine may use
    step_overhead_s: float = 0.003  # per decode step: launches, sampling, TP all-reduce latency
    kv_transfer_bandwidth: float = 10 * GB  # store put/get over a 100 Gb/s link at ~80 %
    max_num_seqs: int = 256  # decode batch limit, as vLLM's default

    def _flops(self, tp: int) -> float:
        return tp * self.gpu.flops * self.gpu.compute_efficiency

    def prefill_seconds(self, prompt_tokens: int) -> float:
        m = self.model
        dense = 2.0 * m.params * prompt_tokens
        attention = 2.0 * m.layers * m.hidden * prompt_tokens * prompt_tokens  # causal QK^T, AV
        return (dense + attention) / self._flops(self.prefill_tp)

    def prefill_tokens_per_second(self) -> float:
        """The capacity model's prior: DESIGN.md's formula without the attention term."""
        return prefill_tokens_per_second(self.model.params, self._flops(self.prefill_tp))

    def kv_transfer_seconds(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.model.kv_bytes_per_token / self.kv_transfer_bandwidth

    def kv_capacity_tokens(self) -> int:
        free = self.decode_tp * self.gpu.memory * self.memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} leaves no KV room on {self.decode_tp} x "
                             f"{self.gpu.name}: raise the decode tensor-parallel size")
        return int(free / self.model.kv_bytes_per_token)

    def decode_step_seconds(self, batch: int, context_tokens: float) -> float:
        """One step for ``batch`` sequences holding ``context_tokens`` KV tokens in all."""
        bandwidth = self.decode_tp * self.gpu.bandwidth * self.gpu.bandwidth_efficiency
        memory = (self.model.weight_bytes + context_tokens * self.model.kv_bytes_per_token)
        compute = 2.0 * self.model.params * batch / self._flops(self.decode_tp)
        return max(memory / bandwidth, compute) + self.step_overhead_s

    def decode_tokens_per_second(self, mean_context: float) -> float:
        """Saturated output tok/s of one decode replica when sequences of ``mean_context``
        tokens fill its KV (or its batch limit): the capacity model's prior."""
        batch = max(1, min(self.max_num_seqs, int(self.kv_capacity_tokens() / mean_context)))
        return batch / self.decode_step_seconds(batch, batch * mean_context)

    def describe(self) -> dict[str, float | int | str]:
        return {
            "gpu": self.gpu.name, "model": self.model.name,
            "prefill_gpus_per_replica": self.prefill_tp, "decode_gpus_per_replica": self.decode_tp,
            "achieved_tflops_per_gpu": self.gpu.flops * self.gpu.compute_efficiency / 1e12,
            "achieved_tb_s_per_gpu": self.gpu.bandwidth * self.gpu.bandwidth_efficiency / 1e12,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "kv_capacity_tokens_per_decode_replica": self.kv_capacity_tokens(),
            "prefill_tokens_per_s_per_replica": round(self.prefill_tokens_per_second()),
        }


def _best_rate(work: Callable[[], object], amount: float, seconds: float) -> float:
    """The best of several short timings: on a shared machine the fastest run is the one the
    hardware was free for, which is what "achieved" means here."""
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        work()
        best = max(best, amount / (time.perf_counter() - start))
    return best


def measure_local_gpu(seconds: float = 0.5) -> Gpu:
    """This machine's achieved matmul FLOP/s and copy bandwidth (numpy, float32): the "local"
    profile. Efficiencies are 1 because the figures are already achieved ones."""
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = _best_rate(lambda: a @ a, 2.0 * n**3, seconds / 2)
    src = np.ones(16 * 2**20, dtype=np.float32)  # 64 MiB: past every cache
    dst = np.empty_like(src)
    bandwidth = _best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes, seconds / 2)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Gpu("local", flops, bandwidth, memory, 1.0, 1.0)


def load_gpu(spec: str) -> Gpu:
    """A named GPU, ``local`` (measured now), or a JSON file with name, flops, bandwidth,
    memory and optionally compute_efficiency and bandwidth_efficiency."""
    if spec in GPUS:
        return GPUS[spec]
    if spec == "local":
        return measure_local_gpu()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown GPU {spec!r}: use one of {', '.join(GPUS)}, local, or a JSON "
                         "file of constants")
    try:
        data = json.loads(path.read_text())
        gpu = Gpu(str(data["name"]), float(data["flops"]), float(data["bandwidth"]),
                  float(data["memory"]))
        if "compute_efficiency" in data:
            gpu = replace(gpu, compute_efficiency=float(data["compute_efficiency"]))
        if "bandwidth_efficiency" in data:
            gpu = replace(gpu, bandwidth_efficiency=float(data["bandwidth_efficiency"]))
        return gpu
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a GPU constants file ({e})") from e


def build_cost_model(gpu: str | Gpu, model: str | ModelShape, prefill_tp: int | None = None,
                     decode_tp: int | None = None) -> CostModel:
    g = load_gpu(gpu) if isinstance(gpu, str) else gpu
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}: use one of {', '.join(MODELS)}")
        model = MODELS[model]
    tp = default_tensor_parallel(model, g)
    cost = CostModel(g, model, prefill_tp or tp, decode_tp or tp)
    cost.kv_capacity_tokens()  # fail now, not mid-simulation
    return cost
