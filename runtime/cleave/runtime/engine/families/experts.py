"""What a mixture-of-experts MLP is, read from a config: torch-free data the dense decoder's
MoE part (``engine/dense/moe.py``) runs. Which layers are sparse is decided here, once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names relative to ``model.layers.{i}.``; ``{e}`` is the expert index.

    Hub checkpoints (and transformers' ``save_pretrained``) keep one Linear per expert; the
    ``fused_*`` names are transformers 5's in-memory layout (``[experts, 2 * inter, hidden]``
    gate/up and ``[experts, hidden, inter]`` down), read when a checkpoint carries them.
    """

    router: str
    gate: str
    up: str
    down: str
    fused_router: str = "mlp.gate.weight"
    fused_gate_up: str = "mlp.experts.gate_up_proj"
    fused_down: str = "mlp.experts.down_proj"


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # Mixtral scales expert outputs by the fp32 routing weights; Qwen3-MoE first casts them to
    # the activation dtype. Same in fp32, a different rounding in bf16.
    fp32_weights: bool
    sparse_layers: frozenset[int]  # layers whose MLP is the experts; the rest stay dense
    names: ExpertNames


def sparse_layers(num_layers: int, num_experts: int, step: int,
                  dense_only: list[int] | None) -> frozenset[int]:
    """Qwen-MoE's rule: layer ``i`` is sparse when ``(i + 1) % step == 0`` and not listed in
    ``mlp_only_layers``; no experts means no sparse layer."""
    if num_experts <= 0:
        return frozenset()
    skip = set(dense_only or [])
    return frozenset(i for i in range(num_layers) if (i + 1) % step == 0 and i not in skip)
