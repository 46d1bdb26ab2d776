"""Mixture-of-experts families: Mixtral (every layer sparse, sliding window optional) and
Qwen3-MoE (Qwen3 attention with q/k norm; sparse layers by ``decoder_sparse_step`` and
``mlp_only_layers``). Routing is softmax over all experts, then top-k, as transformers does."""

from __future__ import annotations

from typing import Any

from cleave.runtime.engine.families.experts import ExpertNames, MoESpec, sparse_layers
from cleave.runtime.engine.families.spec import (
    DecoderSpec,
    UnsupportedModelError,
    WeightNames,
    uniform_layers,
)
from cleave.runtime.engine.shape import ModelShape

_MIXTRAL = ExpertNames(router="block_sparse_moe.gate.weight",
                       gate="block_sparse_moe.experts.{e}.w1.weight",
                       up="block_sparse_moe.experts.{e}.w3.weight",
                       down="block_sparse_moe.experts.{e}.w2.weight")
_QWEN = ExpertNames(router="mlp.gate.weight", gate="mlp.experts.{e}.gate_proj.weight",
                    up="mlp.experts.{e}.up_proj.weight", down="mlp.experts.{e}.down_proj.weight")
_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def _top_k(cfg: Any, num_experts: int) -> int:
    top_k = int(cfg.num_experts_per_tok)
    if not 0 < top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok {top_k} must be in [1, {num_experts}] (the expert count)")
    return top_k


def read_mixtral(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    experts = int(cfg.num_local_experts)
    moe = MoESpec(num_experts=experts, top_k=_top_k(cfg, experts), norm_topk_prob=True,
                  fp32_weights=True, sparse_layers=frozenset(range(shape.num_layers)),
                  names=_MIXTRAL)
    return DecoderSpec(model_type=cfg.model_type, shape=shape,
                       layers=uniform_layers(cfg, shape, getattr(cfg, "sliding_window", None)),
                       rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act, moe=moe)


def read_qwen3_moe(cfg: Any) -> DecoderSpec:
    shape = ModelShape.from_hf_config(cfg)
    experts = int(cfg.num_experts)
    sparse = sparse_layers(shape.num_layers, experts, int(cfg.decoder_sparse_step),
                           getattr(cfg, "mlp_only_layers", None))
    moe = MoESpec(num_experts=experts, top_k=_top_k(cfg, experts) if sparse else 1,
                  norm_topk_prob=bool(cfg.norm_topk_prob), fp32_weights=False,
                  sparse_layers=sparse, names=_QWEN)
    biased = bool(getattr(cfg, "attention_bias", False))
    names = WeightNames(qkv_bias=_QKV_BIAS if biased else (),
                        o_bias="self_attn.o_proj.bias" if biased else None,
                        q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    # The config already folds use_sliding_window into sliding_window (None when off).
    return DecoderSpec(model_type=cfg.model_type, shape=shape,
                       layers=uniform_layers(cfg, shape, getattr(cfg, "sliding_window", None)),
                       rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act, names=names,
                       moe=moe)
