"""Engine configuration: one frozen record, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cleave.common.settings import DEFAULT_MODEL
from cleave.kv_store.block_hash import DEFAULT_BLOCK_SIZE

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    revision: str | None = None  # a hub model's branch, tag or commit (None: main)
    dtype: str = "auto"  # auto: bf16 where the hardware runs it natively, else fp32
    device: str = "auto"  # auto: CUDA when torch sees one, else CPU
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 80 % of free memory on a GPU
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int = 1  # torch threads; >1 collapses when another process takes a core
    cache_dir: Path | None = None
    salt: str = ""  # per-service/tenant: blocks never match across salts
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split over
    # Decode-only steps at fixed shapes (dense/graphs.py): auto captures CUDA graphs on a GPU;
    # on runs the fixed-shape path on any device (eagerly on the CPU: tests, gpu.sh --dry-run).
    decode_graphs: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.decode_graphs not in ("auto", "on", "off"):
            raise ValueError("decode_graphs must be auto, on or off")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")
