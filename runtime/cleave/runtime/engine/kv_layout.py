"""What the KV pool, the store's block bytes and the prefill->decode handoff need of a model:
torch-free, because the router and the KV store reason about blocks without the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Every layer caches ``num_kv_heads`` keys and values of ``head_dim`` per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """One block as the pool exports it: ``[layers, 2 (k, v), kv_heads, tokens, dim]``."""
        return (self.num_layers, 2, self.num_kv_heads, block_size, self.head_dim)

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * block_size * self.head_dim * element_size
