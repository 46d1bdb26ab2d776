"""The paged KV pool: one tensor ``[layers, 2, kv_heads, blocks, block_size, head_dim]``.

Sized from a memory budget rather than a block count, because memory is what an operator
knows (and what runs out). Blocks move in and out whole, as the handoff between prefill and
decode workers needs.
"""

from __future__ import annotations

import torch

from cleave.runtime.engine.llama import LlamaShape


def bytes_per_block(shape: LlamaShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * elem


class KVPool:
    def __init__(self, shape: LlamaShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # kv heads outermost: a decode batch's gathered blocks are then already in the
        # [heads, seqs, tokens, dim] order its attention matmuls read, with no transpose copy.
        self.data = torch.zeros(shape.num_layers, 2, shape.num_kv_heads, num_blocks, block_size,
                                shape.head_dim, dtype=dtype, device=device)
        self.k = [self.data[layer, 0] for layer in range(shape.num_layers)]
        self.v = [self.data[layer, 1] for layer in range(shape.num_layers)]

    @classmethod
    def from_budget(cls, shape: LlamaShape, budget_bytes: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> KVPool:
        per_block = bytes_per_block(shape, block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no block ({per_block} bytes each)")
        return cls(shape, num_blocks, block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' KV: ``[layers, 2, kv_heads, n, block_size, head_dim]``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(3, index)

    def import_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(3, index, kv.to(device=self.data.device, dtype=self.data.dtype))
