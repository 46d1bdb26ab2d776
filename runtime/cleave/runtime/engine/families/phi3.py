"""Phi-3: q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` (already fused the way
the forward wants them), optional partial rotary and one sliding window over every layer."""

from __future__ import annotations

from typing import Any

from cleave.runtime.engine.families.spec import DecoderSpec, WeightNames, uniform_layers
from cleave.runtime.engine.shape import ModelShape

_FUSED = WeightNames(qkv=("self_attn.qkv_proj.weight",), gate_up=("mlp.gate_up_proj.weight",))


def read_phi3(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    window = getattr(cfg, "sliding_window", None)
    return DecoderSpec(model_type=cfg.model_type, shape=shape,
                       layers=uniform_layers(cfg, shape, window), rms_norm_eps=cfg.rms_norm_eps,
                       hidden_act=cfg.hidden_act, names=_FUSED)
