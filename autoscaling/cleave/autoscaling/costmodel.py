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
    attention_dim: int = 0  # query heads x head_dim where it differs from hidden (Qwen3)

    @property
    def attn_dim(self) -> int:
        return self.attention_dim or self.hidden

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


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def load_hf_config(path: str | Path) -> ModelShape:
    """A model's shape from its Hugging Face ``config.json`` (or the folder holding it):
    parameters counted from the dimensions of a dense decoder (embeddings, and an untied LM
    head; attention q/k/v/o; a gated MLP's three matrices; norms are negligible)."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        c = json.loads(p.read_text())
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads", heads))
        head_dim = int(c.get("head_dim") or hidden // heads)
        inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{p}: not a Hugging Face config.json of a dense decoder ({e})") from e
    attn = heads * head_dim
    per_layer = hidden * (2 * attn + 2 * kv_heads * head_dim) + 3 * hidden * inter
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    name = p.parent.name or p.stem
    return ModelShape(name, float(layers * per_layer + embeddings), layers, hidden, kv_heads,
                      head_dim, _DTYPE_BYTES.get(str(c.get("torch_dtype")), 2),
                      attn if attn != hidden else 0)


def load_model(spec: str) -> ModelShape:
    """A named shape (``70b``...) or a Hugging Face config.json (file or folder)."""
    if spec in MODELS:
        return MODELS[spec]
    if Path(spec).exists():
        return load_hf_config(spec)
    raise ValueError(f"unknown model {spec!r}: use one of {', '.join(MODELS)} or the path of a "
                     "Hugging Face config.json")


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
    # Share of a prefill chunk's compute that does not overlap a decode step's weight read when
    # the two ride one step: 0 is the roofline (max of the two), 1 purely additive. Not measured
    # here: Sarathi-Serve (Agrawal et al., OSDI 2024) shows piggybacked chunks nearly free while
    # the step stays memory-bound; 0.3 is an assumption, swept 0-1 in bench/autoscale.py.
    interference: float = 0.3

    def _flops(self, tp: int) -> float:
        return tp * self.gpu.flops * self.gpu.compute_efficiency

    def prefill_seconds(self, prompt_tokens: int) -> float:
        m = self.model
        dense = 2.0 * m.params * prompt_tokens
        attention = 2.0 * m.layers * m.attn_dim * prompt_tokens * prompt_tokens  # causal QK^T, AV
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

    def step_seconds(self, batch: int, context_tokens: float, chunk: int = 0,
                     chunk_offset: int = 0) -> float:
        """One engine step: ``batch`` decoding sequences holding ``context_tokens`` KV tokens,
        plus a prefill chunk of ``chunk`` tokens starting at ``chunk_offset`` of its prompt
        (it reads its prefix's KV and attends causally to it). Roofline of the weight + KV read
        against the dense + attention compute, plus :attr:`interference` of the chunk's compute
        where both run. A prefill-only step (batch 0, offset 0) is :meth:`prefill_seconds`."""
        m = self.model
        tp = self.decode_tp if batch else self.prefill_tp
        kv_read = (context_tokens + chunk_offset) * m.kv_bytes_per_token
        memory = (m.weight_bytes + kv_read) / (tp * self.gpu.bandwidth
                                                * self.gpu.bandwidth_efficiency)
        attention = 2.0 * m.layers * m.attn_dim * chunk * (2 * chunk_offset + chunk)
        chunk_compute = (2.0 * m.params * chunk + attention) / self._flops(tp)
        if batch == 0:
            return chunk_compute if chunk_offset == 0 else max(memory, chunk_compute)
        compute = 2.0 * m.params * batch / self._flops(tp) + chunk_compute
        return (max(memory, compute) + self.interference * min(memory, chunk_compute)
                + self.step_overhead_s)

    def chunk_budget(self, step_s: float) -> int:
        """Tokens per step (decode tokens included, as vLLM's max_num_batched_tokens counts
        them) whose compute, with its interference, fits in ``step_s``: the budget that keeps a
        decode step, and so TPOT, under a target however much prefill rides on it."""
        spare = (step_s - self.step_overhead_s) / (1.0 + self.interference)
        return max(1, int(spare * self._flops(self.decode_tp) / (2.0 * self.model.params)))

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
        model = load_model(model)
    tp = default_tensor_parallel(model, g)
    cost = CostModel(g, model, prefill_tp or tp, decode_tp or tp)
    cost.kv_capacity_tokens()  # fail now, not mid-simulation
    return cost
