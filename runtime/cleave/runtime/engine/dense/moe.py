"""The mixture-of-experts MLP: a router picks ``top_k`` experts per token, and only those run.

Routing is transformers' to the rounding: router logits in the activation dtype, softmax in
fp32 over every expert, top-k, optional renormalisation. Tokens are then grouped by expert (one
stable sort of the flattened choices), so each expert that any token chose runs one gate/up and
one down matmul over exactly its tokens; the outputs, scaled by the routing weights, are summed
over each token's choices as transformers' default (grouped) experts forward sums them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cleave.runtime.engine.families.experts import MoESpec
from cleave.runtime.engine.parallel.shard import Shard

Fetch = Callable[[str], torch.Tensor]
Activation = Callable[[torch.Tensor], torch.Tensor]


class ExpertsMLP:
    def __init__(self, spec: MoESpec, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, act: Activation) -> None:
        self.spec = spec
        self.router = router  # [experts, hidden]
        self.gate_up = gate_up  # [experts, 2 * inter, hidden]
        self.down = down  # [experts, hidden, inter]
        self.act = act

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` for ``x [T, hidden]``."""
        probs = F.linear(x, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.spec.fp32_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        rows = order // self.spec.top_k
        scale = weights.flatten()[order].unsqueeze(-1)
        # One host sync for the per-expert counts; the loop runs only the chosen experts.
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        # Each pair's scaled output, in the dtype activations times routing weights give
        # (fp32 for Mixtral), summed over a token's choices and rounded once at the end: what
        # transformers' default (grouped) experts forward computes.
        pairs = torch.empty(flat.numel(), x.shape[-1], device=x.device,
                            dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            gate, up = F.linear(x[rows[start:end]], self.gate_up[e]).chunk(2, dim=-1)
            pairs[order[start:end]] = F.linear(self.act(gate) * up, self.down[e]) * scale[start:end]
            start = end
        return pairs.view(x.shape[0], self.spec.top_k, -1).sum(dim=1).to(x.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down))


def load_experts(spec: MoESpec, prefix: str, fetch: Fetch, act: Activation,
                 shard: Shard | None = None) -> ExpertsMLP:
    """Experts from a checkpoint's per-expert Linears, or transformers 5's fused tensors.

    With ``shard``, every expert keeps this rank's slice of its intermediate (the router stays
    whole, so every rank routes alike), and the output is a partial sum to all-reduce.
    """
    names = spec.names
    try:
        router = fetch(prefix + names.fused_router)
        gate_up = fetch(prefix + names.fused_gate_up)
        down = fetch(prefix + names.fused_down)
    except KeyError:
        router = fetch(prefix + names.router)
        experts = range(spec.num_experts)
        gate_up = torch.stack([torch.cat((fetch(prefix + names.gate.format(e=e)),
                                          fetch(prefix + names.up.format(e=e))))
                               for e in experts]).contiguous()
        down = torch.stack([fetch(prefix + names.down.format(e=e)) for e in experts]).contiguous()
    if gate_up.shape[0] != spec.num_experts or down.shape[0] != spec.num_experts:
        raise ValueError(f"{prefix}experts: {gate_up.shape[0]} in the checkpoint, "
                         f"{spec.num_experts} in the config")
    if shard is not None:
        gate_up = shard.gate_up(gate_up, dim=1)
        down = shard.columns(down, "the experts' intermediate size")
    return ExpertsMLP(spec, router, gate_up, down, act)
