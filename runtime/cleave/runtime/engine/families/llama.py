"""Llama (2, 3.x with ``llama3``/``linear``/``yarn`` rope scaling) and Mistral (one sliding
window over every layer): the plain pre-norm decoder the others vary."""

from __future__ import annotations

from typing import Any

from cleave.runtime.engine.families.spec import (
    DecoderSpec,
    UnsupportedModelError,
    WeightNames,
    uniform_layers,
)
from cleave.runtime.engine.shape import ModelShape

_BIASED = WeightNames(qkv_bias=("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                "self_attn.v_proj.bias"), o_bias="self_attn.o_proj.bias")


def read_llama(cfg: Any) -> DecoderSpec:
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("MLP biases (mlp_bias) are not supported")
    shape = ModelShape.from_hf_config(cfg)
    return DecoderSpec(model_type=cfg.model_type, shape=shape,
                       layers=uniform_layers(cfg, shape, None), rms_norm_eps=cfg.rms_norm_eps,
                       hidden_act=cfg.hidden_act,
                       names=_BIASED if getattr(cfg, "attention_bias", False) else WeightNames())


def read_mistral(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    window = getattr(cfg, "sliding_window", None)
    return DecoderSpec(model_type=cfg.model_type, shape=shape,
                       layers=uniform_layers(cfg, shape, window), rms_norm_eps=cfg.rms_norm_eps,
                       hidden_act=cfg.hidden_act)
