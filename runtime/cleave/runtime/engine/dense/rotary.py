"""Rotary position tables, computed once per distinct rotary setting of a model.

Frequencies come from transformers' own initialisers for the scaled variants (``llama3``,
``linear``, ``yarn``), so they are the reference's to the bit; positions index the table.
"""

from __future__ import annotations

from typing import Any

import torch

from cleave.runtime.engine.families.spec import RopeSpec


class RotaryTable:
    def __init__(self, rope: RopeSpec, hf_config: Any, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq, scaling = _inv_freq(rope, hf_config)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        # transformers computes cos/sin in fp32, scales, then casts to the activation dtype.
        self.cos = (emb.cos() * scaling).to(dtype)
        sin = (emb.sin() * scaling).to(dtype)
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2], bit for bit (negation is
        # exact): one roll instead of two slices, a negation and a cat per call.
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.rotary_dim = rope.rotary_dim

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, d]`` by a table's ``cos`` and sign-folded ``sin``; with a
    partial rotary only the first ``cos`` width."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + torch.roll(x, rot // 2, -1) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + torch.roll(head, rot // 2, -1) * sin, tail), dim=-1)


def _inv_freq(rope: RopeSpec, hf_config: Any) -> tuple[torch.Tensor, float]:
    if rope.rope_type == "default":
        dim = rope.rotary_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (rope.theta ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope.rope_type]
    if rope.layer_type is None:
        inv_freq, scaling = init(hf_config, None)
    else:
        inv_freq, scaling = init(hf_config, None, layer_type=rope.layer_type)
    return inv_freq, float(scaling)
