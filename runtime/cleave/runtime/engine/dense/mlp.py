"""A layer's MLP as a part the decoder calls: the dense gated MLP, or the experts the family's
spec selects for that layer (:mod:`.moe`)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from cleave.runtime.engine.dense.linear import Linear
from cleave.runtime.engine.dense.moe import Activation, Fetch, load_experts
from cleave.runtime.engine.families.spec import DecoderSpec
from cleave.runtime.engine.native.kernels import Kernels, kernels
from cleave.runtime.engine.parallel.shard import Shard


class MLP(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [tokens, hidden]`` (already normed) -> ``[tokens, hidden]``."""
        ...

    def nbytes(self) -> int: ...


class DenseMLP:
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Activation) -> None:
        self.gate_up = Linear(gate_up)
        self.down = Linear(down)
        self.act = act
        # SiLU-and-mul in one native call where the weights are bf16 on such a CPU
        self.native = kernels() if act is F.silu and self.gate_up.native is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.native is not None and Kernels.takes_rows(gate_up, gate_up.shape[-1] // 2):
            return self.down(self.native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
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
