"""The paged KV pool: one tensor ``[layers, 2, kv_heads, blocks, block_size, head_dim]``.

Sized from a memory budget rather than a block count, because memory is what an operator
knows (and what runs out). Blocks move in and out whole, as the handoff between prefill and
decode workers needs.
"""

from __future__ import annotations

import torch

from cleave.kv_store.buffers import HostBuffers
from cleave.runtime.engine.kv_layout import KVLayout

# Exports awaiting their store write; more is rare (a handful of prompts saving at once).
EXPORT_CACHE_BYTES = 256 << 20


def default_budget(kv_cache_bytes: int | None, device: torch.device) -> int:
    """The configured budget, else 80 % of the GPU's free memory, else 1 GiB on CPU."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return 1 << 30


def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    return layout.bytes_per_block(block_size, torch.empty((), dtype=dtype).element_size())


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # kv heads outermost: a decode batch's gathered blocks are then already in the
        # [heads, seqs, tokens, dim] order its attention matmuls read, with no transpose copy.
        self.layout = layout
        self.data = torch.zeros(layout.num_layers, 2, layout.num_kv_heads, num_blocks, block_size,
                                layout.head_dim, dtype=dtype, device=device)
        self.k = [self.data[layer, 0] for layer in range(layout.num_layers)]
        self.v = [self.data[layer, 1] for layer in range(layout.num_layers)]
        self._export_buffers = HostBuffers(EXPORT_CACHE_BYTES)

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> KVPool:
        per_block = bytes_per_block(layout, block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no block ({per_block} bytes each)")
        return cls(layout, num_blocks, block_size, dtype, device)

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
        buffer, views = self.host_rows(len(block_ids), header_room,
                                       tuple(self.data[:, :, :, 0].shape))
        for view, b in zip(views, block_ids, strict=True):
            view.copy_(self.data[:, :, :, b])
        return buffer, views

    def host_rows(self, n: int, header_room: int, shape: tuple[int, ...]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """An ``[n, header_room + block bytes]`` host buffer and each row's ``shape`` view."""
        block_bytes = self.data.element_size()
        for size in shape:
            block_bytes *= size
        row = header_room + block_bytes
        if self.data.is_cuda or not n:  # torch's host allocator already reuses pinned memory
            buffer = torch.empty(n, row, dtype=torch.uint8, pin_memory=self.data.is_cuda)
        else:
            lease = self._export_buffers.lease(n * row)
            buffer = torch.frombuffer(lease, dtype=torch.uint8, count=n * row).view(n, row)
        return buffer, [buffer[i, header_room:].view(self.data.dtype).view(shape)
                        for i in range(n)]

    def import_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        for b, kv in zip(block_ids, blocks, strict=True):
            self.data[:, :, :, b].copy_(kv)
