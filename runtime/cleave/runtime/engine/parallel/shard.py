"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

q/k/v and gate/up are column-parallel (each rank computes its own heads and its own slice of the
intermediate), o_proj and down are row-parallel (each rank's partial product is summed by one
all-reduce). Slicing works on the fused tensors the dense decoder keeps, so a checkpoint's own
fusion (Phi-3's ``qkv_proj``) needs nothing special. Embeddings, norms, routers and the LM head
stay whole on every rank (replicated): they are small next to the layers at the sizes TP serves,
and a replicated head gives every rank the logits without a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.shape import ModelShape


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def _slice(self, t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if t.shape[dim] % self.size:
            raise TensorParallelError(
                f"tensor parallel size {self.size} does not divide {what} ({t.shape[dim]})")
        return t.chunk(self.size, dim=dim)[self.rank].contiguous()

    def qkv(self, fused: torch.Tensor, shape: ModelShape) -> torch.Tensor:
        """``[(nq + 2 nkv) d, ...]`` -> this rank's q heads, then its k and v heads."""
        d = shape.head_dim
        q, k, v = torch.split(fused, [shape.num_heads * d, shape.num_kv_heads * d,
                                      shape.num_kv_heads * d], dim=0)
        return torch.cat([self._slice(q, 0, "the query heads"),
                          self._slice(k, 0, "the KV heads"),
                          self._slice(v, 0, "the KV heads")]).contiguous()

    def gate_up(self, fused: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``[2 inter, ...]`` (gate then up along ``dim``) -> this rank's slice of each."""
        gate, up = fused.chunk(2, dim=dim)
        return torch.cat([self._slice(gate, dim, "the MLP intermediate size"),
                          self._slice(up, dim, "the MLP intermediate size")], dim=dim).contiguous()

    def columns(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A row-parallel weight ``[..., out, in]``: this rank's slice of the input dimension."""
        return self._slice(t, -1, what)

    def keep_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """A row-parallel layer's bias is added once: by rank 0, before the all-reduce."""
        return bias if self.rank == 0 else None

    def local_layout(self, layout: KVLayout) -> KVLayout:
        return KVLayout(layout.num_layers, layout.num_kv_heads // self.size, layout.head_dim)


def check_divides(shape: ModelShape, size: int) -> None:
    """Refuse, before any weight loads, a size that does not split the heads evenly."""
    if size < 1:
        raise TensorParallelError("tensor parallel size must be at least 1")
    if shape.num_kv_heads % size or shape.num_heads % size:
        raise TensorParallelError(
            f"tensor parallel size {size} does not divide the model's {shape.num_kv_heads} KV "
            f"heads and {shape.num_heads} query heads: each rank holds whole heads, so choose "
            f"a size that divides both")
