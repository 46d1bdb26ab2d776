"""The paged KV pool: one tensor ``[layers, 2, kv_heads, blocks, block_size, head_dim]``.

Sized from a memory budget rather than a block count, because memory is what an operator
knows (and what runs out). Blocks move in and out whole, as the handoff between prefill and
decode workers needs.
"""

from __future__ import annotations

import torch

from cleave.kv_store.buffers import HostBuffers
from cleave.runtime.engine.llama import LlamaShape

# Exports awaiting their store write; more is rare (a handful of prompts saving at once).
EXPORT_CACHE_BYTES = 256 << 20


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
        self._export_buffers = HostBuffers(EXPORT_CACHE_BYTES)

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

    def export_blocks(self, block_ids: list[int], header_room: int = 0
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy blocks out to host memory, one row per block, ``header_room`` bytes in front.

        Returns the ``[n, header_room + block_bytes]`` uint8 buffer and, per block, a
        ``[layers, 2, kv_heads, block_size, head_dim]`` view of its payload. The buffer's
        memory is reused for a later export once nothing refers to this one any more.
        """
        n = len(block_ids)
        block = self.data[:, :, :, 0]
        block_bytes = block.numel() * block.element_size()
        row = header_room + block_bytes
        if self.data.is_cuda or not n:  # torch's host allocator already reuses pinned memory
            buffer = torch.empty(n, row, dtype=torch.uint8, pin_memory=self.data.is_cuda)
        else:
            lease = self._export_buffers.lease(n * row)
            buffer = torch.frombuffer(lease, dtype=torch.uint8, count=n * row).view(n, row)
        views = [buffer[i, header_room:].view(self.data.dtype).view(block.shape)
                 for i in range(n)]
        for view, b in zip(views, block_ids, strict=True):
            view.copy_(self.data[:, :, :, b])
        return buffer, views

    def import_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        for b, kv in zip(block_ids, blocks, strict=True):
            self.data[:, :, :, b].copy_(kv)
