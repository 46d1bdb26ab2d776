"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm by (1 + w), a
norm before and after both attention and MLP, ``query_pre_attn_scalar`` as the attention scale,
tanh soft-capping of logits, alternating sliding/global layers (Gemma 3: q/k norm and a
separate rotary base for the local layers)."""

from __future__ import annotations

from typing import Any

from cleave.runtime.engine.families.spec import (
    DecoderSpec,
    UnsupportedModelError,
    WeightNames,
    typed_layers,
)
from cleave.runtime.engine.shape import ModelShape


def _names(cfg: Any, qk_norm: bool) -> WeightNames:
    biased = bool(getattr(cfg, "attention_bias", False))
    return WeightNames(
        qkv_bias=("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                  "self_attn.v_proj.bias") if biased else (),
        o_bias="self_attn.o_proj.bias" if biased else None,
        attn_out_norm="post_attention_layernorm.weight",
        mlp_in_norm="pre_feedforward_layernorm.weight",
        mlp_out_norm="post_feedforward_layernorm.weight",
        q_norm="self_attn.q_norm.weight" if qk_norm else None,
        k_norm="self_attn.k_norm.weight" if qk_norm else None)


def _read(cfg: Any, names: WeightNames, attn_softcap: float | None) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    return DecoderSpec(
        model_type=cfg.model_type, shape=shape, layers=typed_layers(cfg, shape),
        rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_activation, norm_offset=1.0,
        embed_scale=cfg.hidden_size ** 0.5, attn_scale=cfg.query_pre_attn_scalar ** -0.5,
        attn_softcap=attn_softcap, final_softcap=getattr(cfg, "final_logit_softcapping", None),
        names=names)


def read_gemma2(cfg: Any) -> DecoderSpec:
    return _read(cfg, _names(cfg, qk_norm=False), getattr(cfg, "attn_logit_softcapping", None))


def read_gemma3_text(cfg: Any) -> DecoderSpec:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "bidirectional attention (an embedding model) is not supported: needs causal LM")
    # transformers' Gemma 3 attention never applies attn_logit_softcapping, whatever the config.
    return _read(cfg, _names(cfg, qk_norm=True), None)
