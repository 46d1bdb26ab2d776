"""The interface every model the engine runs implements, and the batch it is handed.

The model runner turns a scheduler step into one flat token batch plus an
:class:`AttentionBatch` saying where each token's KV lives in the paged pool; a
:class:`PagedModel` runs its forward over that, writing new KV into the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from cleave.runtime.engine.kv_layout import KVLayout


@dataclass
class DecodeGroup:
    """Decode tokens ``[first, first + count)``, attended in one padded batch."""

    first: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks]
    mask: torch.Tensor  # [1, count, 1, max_blocks * block_size] bool, True = attend
    lengths: torch.Tensor  # [count] context length including the decoded token
    # Per sliding window (None: none), the keys hidden from each query (True = hidden): built
    # by the first layer that needs it and reused by the rest of the step's layers.
    hidden_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionBatch:
    """How the flat token batch of one step maps onto sequences and the pool.

    Decode tokens come first (one per sequence), prefill chunks after them.
    """

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat index into the pool's (block, offset) slots
    decode_groups: list[DecodeGroup]
    # One entry per prefill chunk: (first token in batch, length, context before the chunk,
    # its block table [n_blocks] through the chunk's end, causal mask when there is context).
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    logits_indices: torch.Tensor  # [S] batch positions whose logits are sampled
    # Per (prefill index, window) masks of windowed or soft-capped layers, built once a step.
    prefill_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


class PagedModel(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (what bounds decode speed)."""
        ...

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        """Run one step; returns fp32 logits for ``batch.logits_indices``.

        ``k_pool[l]`` / ``v_pool[l]`` are ``[kv_heads, num_blocks, block_size, head_dim]``.
        """
        ...
