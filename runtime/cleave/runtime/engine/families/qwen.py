"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm); both may mark layers
``sliding_attention`` through ``layer_types``."""

from __future__ import annotations

from typing import Any

from cleave.runtime.engine.families.spec import DecoderSpec, WeightNames, typed_layers
from cleave.runtime.engine.shape import ModelShape

_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def read_qwen2(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    return DecoderSpec(model_type=cfg.model_type, shape=shape, layers=typed_layers(cfg, shape),
                       rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
                       names=WeightNames(qkv_bias=_QKV_BIAS))


def read_qwen3(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    biased = bool(getattr(cfg, "attention_bias", False))
    names = WeightNames(qkv_bias=_QKV_BIAS if biased else (),
                        o_bias="self_attn.o_proj.bias" if biased else None,
                        q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    return DecoderSpec(model_type=cfg.model_type, shape=shape, layers=typed_layers(cfg, shape),
                       rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act, names=names)
