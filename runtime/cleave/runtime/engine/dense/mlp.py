"""A layer's MLP as a part the decoder calls: the dense gated MLP, or the experts the family's
spec selects for that layer (:mod:`.moe`)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense.linear import Linear
from cleave.runtime.engine.dense.moe import Activation, Fetch, load_experts
from cleave.runtime.engine.families.spec import DecoderSpec
from cleave.runtime.engine.parallel.shard import Shard


class MLP(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [tokens, hidden]`` (already normed) -> ``[tokens, hidden]``."""
        ...

    def nbytes(self) -> int: ...


class DenseMLP:
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul (and SiLU-and-mul
    into its epilogue, where the native GEMM runs it: :class:`Linear`'s ``silu_and_mul``)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Activation) -> None:
        self.gate_up = Linear(gate_up, silu_and_mul=act is F.silu)
        self.down = Linear(down)
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up.fused:
            return self.down(self.gate_up(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()


def load_mlp(spec: DecoderSpec, index: int, fetch: Fetch, act: Activation,
             shard: Shard | None = None) -> MLP:
    """With ``shard``, this rank's slice of the intermediate: its output is a partial sum."""
    prefix = f"model.layers.{index}."
    if spec.moe is not None and index in spec.moe.sparse_layers:
        return load_experts(spec.moe, prefix, fetch, act, shard)
    parts = [fetch(prefix + p) for p in spec.names.gate_up]
    gate_up = parts[0] if len(parts) == 1 else torch.cat(parts).contiguous()
    down = fetch(prefix + spec.names.down)
    if shard is not None:
        gate_up, down = shard.gate_up(gate_up), shard.columns(down, "the MLP intermediate size")
    return DenseMLP(gate_up, down, act)
